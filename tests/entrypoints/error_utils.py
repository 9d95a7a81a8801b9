"""Checks on OpenAI's error body, shared by the server tests."""

import httpx


def assert_error(response: httpx.Response, status: int, *fragments: str, param="any", code="any") -> dict:
    """Assert ``response`` is ``status`` with OpenAI's body ``{"error": {"message", "type", "param",
    "code"}}``, its message holding each of ``fragments`` and, unless "any", that ``param`` and
    ``code``. Returns the ``error`` object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    return error
