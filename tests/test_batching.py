"""Batches in, loss and outputs out: the batch shapes users' loaders give."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch

import autoprec
from autoprec.batching import as_plain, count_samples, count_tokens, map_tensors, to_device
from autoprec.fingerprint import tensor_digest


def _mapping_batch() -> UserDict:
    """A batch as a Hugging Face collator returns it: a mapping that is not a dict."""
    ids = torch.arange(24).reshape(4, 6) % 10
    return UserDict({"input_ids": ids, "labels": ids.clone()})


def test_a_mapping_that_is_not_a_dict_is_opened_like_one() -> None:
    # torch's pytree took a UserDict / BatchEncoding as one opaque leaf: no tensor was found
    # ("A batch must contain at least one tensor"), none would be moved to the GPU
    batch = _mapping_batch()
    assert count_samples(batch) == 4
    assert count_tokens(batch) == 24
    doubled = map_tensors(lambda tensor: tensor * 2, batch)
    assert type(doubled) is UserDict  # the user's type kept (a train_step may rely on it)
    assert torch.equal(doubled["labels"], batch["labels"] * 2)
    nested = map_tensors(lambda tensor: tensor + 1, [batch, {"inner": batch}])
    assert torch.equal(nested[1]["inner"]["input_ids"], batch["input_ids"] + 1)
    moved = to_device(batch, "cpu")
    assert type(moved) is UserDict and torch.equal(moved["input_ids"], batch["input_ids"])


def test_a_digest_of_mapping_batches_reads_every_value() -> None:
    # a UserDict's repr stands in for its tensors when it is a leaf; torch elides long ones
    big = UserDict({"x": torch.zeros(2000)})
    other = UserDict({"x": torch.zeros(2000)})
    other["x"][1000] = 1.0
    assert repr(big) == repr(other)
    assert as_plain([big]) == [{"x": big["x"]}]
    assert tensor_digest(as_plain([big])) != tensor_digest(as_plain([other]))


def test_check_trains_a_hugging_face_model_on_collator_batches() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        ids = torch.randint(0, 64, (4, 16), generator=generator)
        batches.append(transformers.BatchEncoding({"input_ids": ids, "labels": ids}))
    # failed with "embedding(): argument 'indices' must be Tensor, not BatchEncoding"
    report = autoprec.check(model, batches, steps=4, modes=["amp_bf16"], progress=False)
    assert report.verdict("amp_bf16").status == "safe"
