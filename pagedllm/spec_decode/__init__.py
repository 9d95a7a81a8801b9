"""Speculative decoding: proposers of draft tokens and the controller that sizes them per request
(verification and the acceptance rule live where the logits are: ``worker/model_runner.py``)."""
