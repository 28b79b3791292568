"""Batches in, loss and outputs out: the batch shapes users' loaders give."""

from __future__ import annotations

from collections import UserDict
from collections.abc import Iterator, Mapping

import pytest
import torch

import autoprec
from autoprec.batching import (
    FreshBatches,
    WatchedBatches,
    as_plain,
    count_batch,
    map_tensors,
    prediction,
    same_batch,
    to_device,
)
from autoprec.fingerprint import tensor_digest


def _mapping_batch() -> UserDict:
    """A batch as a Hugging Face collator returns it: a mapping that is not a dict."""
    ids = torch.arange(24).reshape(4, 6) % 10
    return UserDict({"input_ids": ids, "labels": ids.clone()})


def test_a_mapping_that_is_not_a_dict_is_opened_like_one() -> None:
    # torch's pytree took a UserDict / BatchEncoding as one opaque leaf: no tensor was found
    # ("A batch must contain at least one tensor"), none would be moved to the GPU
    batch = _mapping_batch()
    assert count_batch(batch) == (4, 24)
    doubled = map_tensors(lambda tensor: tensor * 2, batch)
    assert type(doubled) is UserDict  # the user's type kept (a train_step may rely on it)
    assert torch.equal(doubled["labels"], batch["labels"] * 2)
    nested = map_tensors(lambda tensor: tensor + 1, [batch, {"inner": batch}])
    assert torch.equal(nested[1]["inner"]["input_ids"], batch["input_ids"] + 1)
    moved = to_device(batch, "cpu")
    assert type(moved) is UserDict and torch.equal(moved["input_ids"], batch["input_ids"])


class _Fields(Mapping):
    """A batch read as ``batch.x`` and ``batch["x"]``, built from two tensors (not a dict)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __getitem__(self, key: str) -> torch.Tensor:
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(("x", "y"))

    def __len__(self) -> int:
        return 2


class _SettableFields(_Fields):
    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        setattr(self, key, value)


def test_a_mapping_whose_class_takes_no_dict_is_kept_or_refused_not_made_a_dict() -> None:
    """Found by a hunt: such a batch became a plain dict (on the CPU too, where nothing moves),
    and a train_step reading batch.x failed, blamed on the batches."""
    batch = _Fields(torch.ones(2, 3), torch.zeros(2))
    assert to_device(batch, "cpu") is batch  # nothing moved: the batch itself
    with pytest.raises(autoprec.BatchError, match=r"type _Fields \(a Mapping\) cannot be rebuilt"):
        map_tensors(torch.clone, batch)
    settable = _SettableFields(torch.ones(2, 3), torch.zeros(2))
    copied = map_tensors(lambda tensor: tensor * 2, settable)
    assert type(copied) is _SettableFields and copied is not settable
    assert torch.equal(copied.x, settable.x * 2) and torch.equal(settable.x, torch.ones(2, 3))


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


def test_fresh_batches_hand_out_copies_and_watched_ones_see_a_change() -> None:
    originals = [(torch.ones(2, 3), torch.zeros(2)), (torch.ones(2, 3), torch.zeros(2))]
    fresh = FreshBatches(originals)
    assert len(fresh) == 2 and fresh[0][0] is not originals[0][0]
    assert same_batch(fresh[0], originals[0])
    assert same_batch((torch.tensor([float("nan")]),), (torch.tensor([float("nan")]),))
    watched = WatchedBatches(originals, keep=1)
    copy = watched[0]
    watched[1][0].mul_(2)  # a copy read after the kept ones: not watched
    assert not watched.changed()
    copy[0].mul_(0.5)  # a forward that scales its input in place
    assert watched.changed()
    assert torch.equal(originals[0][0], torch.ones(2, 3))  # the user's batch is untouched
    keyed = WatchedBatches([{"x": torch.ones(2)}])
    keyed[0]["x"] = torch.zeros(2)  # a train_step that replaces a value of its batch dict
    assert keyed.changed() and torch.equal(keyed.batches[0]["x"], torch.ones(2))


def test_one_number_is_never_the_prediction_whatever_its_shape() -> None:
    """Found by a hunt: a loss returned as shape (1,) was compared as the model's prediction,
    alone or ahead of the logits in a tuple; a scalar loss never was."""
    loss, logits = torch.tensor([0.7]), torch.randn(4, 10)
    assert prediction(loss) is None and prediction(loss.squeeze()) is None
    assert prediction((loss, logits)) is logits
    assert prediction({"aux": loss, "scores": logits}) is logits
    assert prediction(torch.randn(4, 1)) is not None  # one output per sample: a prediction


def test_samples_and_tokens_are_counted_from_the_batch_not_its_first_tensor() -> None:
    """Found by a hunt: the first tensor's leading dimension and the first 2-D integer tensor
    counted one sample and T tokens for a batch led by position_ids of shape (1, T)."""
    ids = torch.zeros(8, 16, dtype=torch.long)
    position_ids = torch.arange(16).unsqueeze(0)
    assert count_batch({"position_ids": position_ids, "input_ids": ids}) == (8, 128)
    assert count_batch((position_ids, ids)) == (8, 128)  # no names: the leading 1 broadcasts
    causal = torch.ones(16, 16).tril()  # found by a review: (8, 16) shared by fewer tensors
    assert count_batch({"idx": ids, "pos": torch.arange(16), "mask": causal}) == (8, 128)
    one = torch.zeros(1, 16, dtype=torch.long)  # and a real batch of one was counted as 16
    assert count_batch((one, one.clone(), causal)) == (1, 16)
    assert count_batch((one, one.clone(), torch.arange(16))) == (1, 16)
    image = {"x": torch.zeros(1, 3, 8, 8), "y": torch.zeros(1), "w": torch.zeros(10)}
    assert count_batch(image) == (1, None)
    assert count_batch((torch.randn(4, 3), torch.randint(0, 2, (4,)))) == (4, None)
    pixels = {"pixel_values": torch.randn(2, 3, 8, 8), "labels": torch.tensor([1, 0])}
    assert count_batch(pixels) == (2, None)
    with pytest.raises(autoprec.BatchError, match="at least one tensor with a batch dimension"):
        count_batch({"x": torch.tensor(1.0)})
