"""course_lib.notebooks.ddp_program: notebook 04's programs, run as the notebook runs them."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from course_lib.launch import free_port, retry_if_port_taken, spawn
from course_lib.notebooks import ddp_program
from course_lib.utils.digits import batch_slice, digits_tensors, mlp


def _one_process_params(steps=20):
    """What train_steps must give, computed another way: one process, no DDP, SGD on each whole
    global batch from rank 0's init."""
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, _, _ = digits_tensors(seed=0)
    for step in range(steps):
        rows = batch_slice(step, 64, len(x))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_the_plain_ddp_program_under_mp_spawn_agrees_with_launch_spawn(tmp_path):
    mp.spawn(ddp_program.ddp_program, args=(2, str(tmp_path)), nprocs=2)
    plain = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ours = spawn(ddp_program.train_steps, 2, backend="gloo")
    # every rank starts from its own init; DDP broadcasts rank 0's, so all four end the same
    for result in plain[1:] + ours:
        torch.testing.assert_close(result["params"], plain[0]["params"], rtol=0, atol=1e-6)
    # and what they agree on is right: one process on the whole batches
    torch.testing.assert_close(plain[0]["params"], _one_process_params(), rtol=1e-5, atol=1e-5)


def test_subgroup_all_reduce_and_a_timeout_instead_of_a_hang():
    outs = spawn(ddp_program.subgroup_and_timeout, 3, 1.0, backend="gloo", timeout_s=60)
    assert [o["after_subgroup_all_reduce"] for o in outs] == [11.0, 11.0, 100.0]
    assert outs[0]["timeout"].startswith("RuntimeError") and "Timed out" in outs[0]["timeout"]
    # the group's 1 s timeout fired (the launcher's 60 s one would have raised TimeoutError from spawn), and
    # not before it was due: how soon after, depends on the machine's load and is not checked
    assert outs[0]["timeout_elapsed_s"] >= 0.9  # (0.1 s for two clocks that need not agree to the tick)


def test_torchs_bf16_hook_is_refused_on_a_cpu_build():
    # DDP checks how torch was built, not whether a GPU is there: a CUDA build accepts it even on gloo
    message = spawn(ddp_program.torch_bf16_refusal, 2, backend="gloo")[0]
    if not ddp_program.ddp_accepts_bf16_hook():
        assert message.startswith("TypeError") and "NCCL" in message
    else:
        assert message == "accepted", message


def test_a_taken_port_fails_at_once_and_a_retry_gives_each_of_two_nodes_processes_its_ranks():
    with socket.socket() as holder:  # another program on the rendezvous port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with pytest.raises(RuntimeError, match=r"codes \[1, None\]") as info:  # node 1 stopped, not waited for
            ddp_program.two_node_torchrun(taken, timeout_s=100)
        ports = iter([taken])  # the retry's second try takes a fresh port
        _, lines = retry_if_port_taken(lambda: ddp_program.two_node_torchrun(next(ports, None) or free_port()))
    assert "node 0: the port was taken (EADDRINUSE)" in str(info.value)
    # and the run that got through gave each of its 4 processes its ranks (one torchrun pair for both checks)
    fields = [dict(kv.split("=", 1) for kv in line.split()) for line in lines]
    assert [f["RANK"] for f in fields] == ["0", "1", "2", "3"]
    for f in fields:
        assert int(f["RANK"]) == int(f["GROUP_RANK"]) * 2 + int(f["LOCAL_RANK"])
        assert f["WORLD_SIZE"] == "4" and f["LOCAL_WORLD_SIZE"] == "2" and f["all_reduce(1)"] == "4"
