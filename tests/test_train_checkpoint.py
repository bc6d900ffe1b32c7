"""Checkpoint files: round trip, atomic replacement, pruning, RNG streams, manifest hashes."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from engine import checkpoint as ckpt
from engine.manifest import sha256_file


def _save(root, step, generators, **extra):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return ckpt.save_checkpoint(root, step, adapter={"a.weight": model.weight.detach().clone()},
                                optimizer=opt.state_dict(), scheduler={"last_epoch": step},
                                rng=ckpt.capture_rng(generators), state={"data": {"epoch": 1, "pos": 3, "n": 9}},
                                spec={"seed": 0}, **extra), model, opt


def test_round_trip_restores_every_random_stream(tmp_path):
    gens = {"sampling": torch.Generator().manual_seed(1), "aqn": torch.Generator().manual_seed(2)}
    torch.manual_seed(5)
    random.seed(6)
    torch.randn(3, generator=gens["aqn"])
    path, model, opt = _save(tmp_path, 7, gens)
    expected = (torch.randn(4), random.random(), torch.randn(4, generator=gens["sampling"]),
                torch.randn(4, generator=gens["aqn"]))

    torch.manual_seed(99)
    random.seed(99)
    fresh = {"sampling": torch.Generator().manual_seed(50), "aqn": torch.Generator().manual_seed(51)}
    loaded = ckpt.load_checkpoint(path)
    ckpt.restore_rng(loaded.rng, fresh)
    got = (torch.randn(4), random.random(), torch.randn(4, generator=fresh["sampling"]),
           torch.randn(4, generator=fresh["aqn"]))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])
    assert loaded.step == 7 and loaded.state["data"] == {"epoch": 1, "pos": 3, "n": 9}
    assert torch.equal(loaded.adapter["a.weight"], model.weight.detach())
    opt2 = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    opt2.load_state_dict(loaded.optimizer)
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_keeps_last_two_and_leaves_no_temporaries(tmp_path):
    gens = {"g": torch.Generator().manual_seed(0)}
    for step in (5, 10, 15):
        _save(tmp_path, step, gens)
    (tmp_path / ".tmp-step-000020-123").mkdir()  # a write interrupted by a crash
    _save(tmp_path, 20, gens)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step-000015", "step-000020"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000020"
    assert ckpt.load_checkpoint(tmp_path).step == 20  # the checkpoints/ dir resolves to its newest


def test_same_step_is_replaced_whole(tmp_path):
    gens = {"g": torch.Generator().manual_seed(0)}
    first, _, _ = _save(tmp_path, 5, gens)
    before = json.loads((first / "state.json").read_text())
    second, _, _ = _save(tmp_path, 5, gens)
    assert first == second and json.loads((second / "state.json").read_text()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["step-000005"]


def test_kept_adapters_outlive_pruning_and_a_step_kept_again_is_replaced(tmp_path):
    def adapter(d, marker):
        (d / "adapter").mkdir()
        (d / "adapter" / "adapter_config.json").write_text(json.dumps({"marker": marker}))
        (d / "adapter" / "adapter_model.safetensors").write_bytes(os.urandom(64))

    gens, kept = {"g": torch.Generator().manual_seed(0)}, tmp_path / "checkpoint-adapters"
    for step in (1, 2, 3):
        path, _, _ = _save(tmp_path / "checkpoints", step, gens, extra=lambda d, s=step: adapter(d, s))
        ckpt.keep_adapter(path, kept)
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step-000002", "step-000003"]
    assert [p.name for p in sorted(kept.iterdir())] == ["step-000001", "step-000002", "step-000003"]
    assert json.loads((kept / "step-000001" / "adapter_config.json").read_text()) == {"marker": 1}
    live = tmp_path / "checkpoints" / "step-000003" / "adapter" / "adapter_model.safetensors"
    assert os.path.samefile(live, kept / "step-000003" / "adapter_model.safetensors")  # a link, not a copy
    path, _, _ = _save(tmp_path / "checkpoints", 3, gens, extra=lambda d: adapter(d, "again"))  # a resumed run
    ckpt.keep_adapter(path, kept)
    assert json.loads((kept / "step-000003" / "adapter_config.json").read_text()) == {"marker": "again"}
    assert [p.name for p in sorted(kept.iterdir())] == ["step-000001", "step-000002", "step-000003"]


def test_incomplete_checkpoint_is_refused(tmp_path):
    gens = {"g": torch.Generator().manual_seed(0)}
    path, _, _ = _save(tmp_path, 5, gens)
    (path / "rng.pt").unlink()
    with pytest.raises(FileNotFoundError, match="rng.pt"):
        ckpt.load_checkpoint(path)


def test_missing_generator_state_is_an_error(tmp_path):
    path, _, _ = _save(tmp_path, 5, {"sampling": torch.Generator().manual_seed(0)})
    with pytest.raises(ValueError, match="aqn"):
        ckpt.restore_rng(ckpt.load_checkpoint(path).rng, {"aqn": torch.Generator()})


def test_sha256_file_matches_hashlib(tmp_path):
    import hashlib

    data = os.urandom(3_000_001)  # spans several 1 MiB read blocks
    f = tmp_path / "blob"
    f.write_bytes(data)
    assert sha256_file(f) == hashlib.sha256(data).hexdigest()
