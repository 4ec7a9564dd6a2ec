"""The committed GPU results (benchmarks/results/gpu_check.json): measured on a GPU, every check the
notebooks cite present and passed, and refused where they would be mistaken for a GPU's."""

import json

import pytest

from course_lib.notebooks import gpu_results

R = gpu_results.load()
S = R["sections"]


def test_the_results_name_a_gpu_and_its_software():
    env = R["environment"]
    assert "NVIDIA" in env["device"] and env["cuda"] and env["nccl"]
    assert gpu_results.label(R).startswith(env["device"]) and env["date_utc"][:10] in gpu_results.label(R)


def test_a_dry_run_is_refused(tmp_path):
    dry = dict(R, dry_run=True)
    (tmp_path / "dry.json").write_text(json.dumps(dry))
    with pytest.raises(ValueError, match="dry run"):
        gpu_results.load(tmp_path / "dry.json")
    with pytest.raises(FileNotFoundError, match="gpu_check.py"):
        gpu_results.load(tmp_path / "missing.json")


def test_nccl_at_world_size_one_ran_every_path():
    one = S["1 NCCL, world size 1"]
    assert one["placement"]["backend"] == "nccl" and one["placement"]["worker_device"] == "cuda:0"
    assert one["torchrun"]["returncode"] == 0 and "backend=nccl" in one["torchrun"]["stdout"]
    assert one["sweep"]["backend"] == "nccl" and len(one["sweep"]["all_reduce"]) == 9
    assert one["accumulation"]["all_reduces_per_step"] == {"sync": [4, 4], "no_sync": [1, 1]}
    assert one["torch_bf16_compress_hook"]["accepted"]
    order = one["torch_powersgd_order"]["nccl"]["last_step"]
    assert len({thread for thread, _ in order}) == 1  # one thread issued every collective, bucket by bucket


def test_every_course_hook_trained_on_cuda_over_gloo_as_on_the_cpu():
    two = S["2 CUDA tensors over gloo, 2 ranks"]
    for name, row in two["hooks"].items():
        assert row["ok"] and row["ranks_identical"] and row["bytes_equal_cpu"], name
        assert row["max_rel_vs_cpu"] < (1e-3 if "wrapper" in name else 1e-6), name
    assert two["course_vs_torch_powersgd"]["max_rel"] < 1e-5 and two["course_vs_torch_powersgd"]["compressed"]
    assert all(row["ranks_identical"] and row["max_rel_vs_cpu"] < 1e-6 for row in two["sharding"].values())
    assert two["local_sgd"]["averager_max_error"] == 0 and two["local_sgd"]["diloco_ranks_identical"]


def test_the_timings_the_notebooks_read_are_there():
    t, step = S["3 timings"], S["3 training step"]
    assert {r["shape"][0] for r in t["square"]} == {1024, 4096}
    assert t["resnet18"]["matrices"] == 21 and t["resnet18_step"]["shapes_match_course_lib"]
    assert all("encode_decode_s" in r for r in t["codecs"]["rows"])
    for name in ("all-reduce", "fp16", "PowerSGD r=1", "PowerSGD r=2", "PowerSGD r=4"):
        assert step[name]["compute_s"] > 0 and step[name]["kernels_per_step"] > 0 and len(step[name]["rounds_s"]) == 3
