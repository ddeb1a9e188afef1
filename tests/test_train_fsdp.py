"""FSDP2 code path on two CPU ranks (gloo): same update as one process, full state dicts, checkpoints.

Marked slow (two spawned interpreters import torch + transformers); GPUs are not needed: FSDP2's
``fully_shard`` runs on CPU with gloo, which exercises the same sharding/gathering code.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from test_train_trainer import TEMP, sampled, tiny_model

    from legorl.train.trainer import Trainer

    model = tiny_model()
    seqs = sampled(model, [1.0, -1.0])  # every rank trains on the same batch: the mean is the batch
    tr = Trainer(model, lr=1e-3, temperature=TEMP, fsdp=True)
    m = tr.train_step(seqs)
    sd = tr.state_dict_for_engine()  # gathered on rank 0
    tr.save(Path(out) / "ckpt")
    dist.barrier()
    tr.load(Path(out) / "ckpt")
    if rank == 0:
        torch.save({"metrics": m, "state": sd, "step": tr.step}, Path(out) / "rank0.pt")
    dist.destroy_process_group()


def test_fsdp2_two_cpu_ranks_match_one_process(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from test_train_trainer import TEMP, sampled, tiny_model

    from legorl.train.trainer import Trainer

    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    model = tiny_model()
    tr = Trainer(model, lr=1e-3, temperature=TEMP)
    ref = tr.train_step(sampled(model, [1.0, -1.0]))
    assert got["metrics"]["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-5)
    assert got["step"] == 1
    want = model.state_dict()
    assert set(got["state"]) == set(want)
    for k, v in want.items():
        assert torch.allclose(got["state"][k], v, atol=1e-6), k
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.allclose(loaded.model.embed_tokens.weight, want["model.embed_tokens.weight"], atol=1e-6)
