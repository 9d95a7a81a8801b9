"""The shape of vLLM's ``examples/basic/online_serving/watermark_detection_server.py`` against our
detector: a FastAPI app whose ``POST /detect`` takes ``{"text"}``, tokenizes it with
``pagedllm.tokenizers.cached_get_tokenizer`` (no special tokens) and answers the detector's four
fields; run through FastAPI's ``TestClient``. The watermarked text comes from the Gumbel
watermarker over a random "language model" (logits drawn afresh each step), written with the
word-level tokenizer so it re-encodes to the same ids.
"""

from __future__ import annotations

import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from pagedllm.tokenizers import TokenizerLike, cached_get_tokenizer
from pagedllm.v1.watermarking import GumbelWatermarkDetector
from pagedllm.watermarking import GumbelWatermarker

KEY = 1234


class DetectIn(BaseModel):
    text: str


class DetectOut(BaseModel):
    score: float
    p_value: float
    num_scored_tokens: int
    is_watermarked: bool


def make_app(tokenizer: TokenizerLike, detector: GumbelWatermarkDetector) -> FastAPI:
    app = FastAPI()

    @app.post("/detect")
    def detect(body: DetectIn) -> DetectOut:
        d = detector.detect(tokenizer.encode(body.text, add_special_tokens=False))
        return DetectOut(score=d.score, p_value=d.p_value, num_scored_tokens=d.num_scored_tokens,
                         is_watermarked=d.is_watermarked)

    return app


def _text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_detection_server_flags_watermarked_text(wordlevel_tokenizer_dir):
    tokenizer = cached_get_tokenizer(wordlevel_tokenizer_dir)
    assert cached_get_tokenizer(wordlevel_tokenizer_dir) is tokenizer and isinstance(tokenizer, TokenizerLike)
    gen = torch.Generator().manual_seed(0)
    marker = GumbelWatermarker(KEY)
    ids: list[int] = []
    plain: list[int] = []
    for _ in range(100):
        logits = torch.randn(1, 512, generator=gen) * 2.0
        ctx = torch.tensor([([-1] * 4 + ids)[-4:]])
        ids.append(int(marker.sample(logits, ctx)))
        plain.append(int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen)))
    assert tokenizer.encode(_text(ids), add_special_tokens=False) == ids

    client = TestClient(make_app(tokenizer, GumbelWatermarkDetector(KEY, context_width=4, p_value_threshold=0.01,
                                                                     prf="philox")))
    r = client.post("/detect", json={"text": _text(ids)})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"score", "p_value", "num_scored_tokens", "is_watermarked"}
    assert body["is_watermarked"] is True and body["p_value"] < 1e-6 and body["num_scored_tokens"] == 100
    body = client.post("/detect", json={"text": _text(plain)}).json()
    assert body["is_watermarked"] is False and body["p_value"] >= 0.01
    assert client.post("/detect", json={}).status_code == 422
