"""Samples of θ_global (`dilocod.trainer.sampling`, `runview.newest_sample`): greedy, so the same weights write
the same text; a status record carries it; the dashboard's API shows the newest, with the round it came from."""

from __future__ import annotations

import torch

from dilocod.data.tokenizer import BYTE, eos_id, load_tokenizer
from dilocod.observability.runview import newest_sample
from dilocod.trainer.model import ModelConfig, build_model
from dilocod.trainer.sampling import MAX_CHARS, Sampler, run_sampler
from proto import decode_status, encode_status
from proto.records import STATUS
from tests.test_proto import example


def test_greedy_completion_is_the_same_for_the_same_weights_and_leaves_the_model_training() -> None:
    tok = load_tokenizer(BYTE)
    sampler = Sampler(tok, "The", 40, eos_id(tok))
    a, b = build_model(ModelConfig("tiny"), seed=1), build_model(ModelConfig("tiny"), seed=1)
    a.train()
    text = sampler(a)
    assert a.training and text == sampler(b) and 0 < len(text) <= MAX_CHARS
    with torch.no_grad():
        b.embed.weight.add_(torch.randn_like(b.embed.weight))  # other weights, other words
    assert sampler(b) != text


def test_a_run_without_its_tokenizer_here_samples_nothing(tmp_path: object) -> None:
    assert run_sampler(None, 512, "The", 8) is None
    assert run_sampler(None, 256, "The", 8) is not None  # the byte tokenizer needs no file


def test_newest_sample_is_the_text_most_peers_wrote_at_the_newest_step() -> None:
    records = [
        {"peer_id": "a", "sample": "old", "sample_step": 2},
        {"peer_id": "b", "sample": " cat", "sample_step": 4},
        {"peer_id": "c", "sample": " cat", "sample_step": 4},
        {"peer_id": "d", "sample": " dog", "sample_step": 4},
        {"peer_id": "e"},
    ]
    assert newest_sample(records, "The") == {
        "prompt": "The", "text": " cat", "outer_step": 4, "peer_id": "b", "peers_agreeing": 2, "peers_sampled": 3,
    }  # fmt: skip
    assert newest_sample([{"peer_id": "e"}], "The") is None


def test_a_status_record_carries_a_sample() -> None:
    record = {**example(STATUS), "sample": "ü" * MAX_CHARS, "sample_step": 6}
    back = decode_status(encode_status(record))
    assert (back["sample"], back["sample_step"]) == ("ü" * MAX_CHARS, 6)
