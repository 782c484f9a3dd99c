"""Several devices (unsloth_jax.distributed): the mesh, the sharding rules, the sharded step, checkpoints across
meshes, two jax.distributed processes and memory per device.

The argument checks and rules run in this process. Everything that needs several devices runs in a subprocess
(tests/multidevice_cases.py, the cases batched into one process per device count) with
XLA_FLAGS=--xla_force_host_platform_device_count=N, because that flag only takes effect before jax initializes.
The truth there is the same step on one device, in the same subprocess.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.conftest import fresh_seed
from tests.helpers import ROOT, made_once, subprocess_env
from unsloth_jax import distributed
from unsloth_jax.data import DataLoader

TOL = 1e-5  # float32 relative error bound of sharded against single-device results


def _run_cases(args: list[str], devices: int, timeout: int) -> tuple[list[str], str]:
    """`python -m tests.multidevice_cases *args` with `devices` forced CPU devices: its RESULT lines (the prefix
    cut) and, for error messages, its exit status with the ends of its stdout and stderr."""
    env = subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(devices))
    cmd = [sys.executable, "-m", "tests.multidevice_cases", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [x[len("RESULT "):] for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return lines, f"rc {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


# The subprocesses below mostly compile: LLVM at -O0 (the same partitioned programs, compiled several times
# faster). Not tests.helpers.quick_codegen()'s fusion-emitters switch: with it, a CI run's 4-device process hung in
# a train step (XLA's CPU collectives waiting on each other, terminated after 40 s). Every comparison here has a
# tolerance.
QUICK_COMPILE = "--xla_backend_optimization_level=0"


def _xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {QUICK_COMPILE}"


# The cases of the tests below, in three processes (tests.multidevice_cases batch): one start and one set of eager
# compiles per process instead of one per case, and the qlora "full" and "offload" cases share their single-device
# truth. The resumed trainer reads the 8-device trainer's checkpoint, so its batch runs after that one; it has a
# process of its own, as it had before the batching (the one CI hang above was in it, after the MoE case). Each
# batch runs once per test run, in the first pytest worker that asks (Cases, below).
def _batches(out: str) -> dict[str, tuple[int, dict[str, list]]]:
    """batch name -> (devices, {case name: [case, kwargs]}), in the order they run."""
    trainer = dict(output_dir=out, max_steps=4, shard_trainable=True)
    return {
        "2 devices, DPO and GRPO": (2, {"rl_steps": ["rl_equal_steps", {}],
                                        "dpo_trainer": ["dpo_trainer", dict(output_dir=out)],
                                        "vision_trainer": ["vision_trainer", dict(output_dir=out)],
                                        "grpo_trainer": ["grpo_trainer", dict(output_dir=out)]}),
        "8 devices": (8, {"equal_lora_full": ["equal_steps", dict(kind="lora", remat="full")],
                          "equal_qlora_full": ["equal_steps", dict(kind="qlora", remat="full")],
                          "equal_qlora_offload": ["equal_steps", dict(kind="qlora", remat="offload")],
                          "fsdp_shards": ["fsdp_shards", {}],
                          "memory": ["memory", dict(single=False)],
                          "trainer_fsdp8": ["trainer", dict(mesh="fsdp=8", per_device=1, save_steps=2, **trainer)],
                          "pallas_on_mesh": ["pallas_on_mesh", {}]}),
        "4 devices, MoE": (4, {"moe": ["moe_equal_steps", {}]}),
        "4 devices, resumed trainer": (4, {"trainer_resumed": ["trainer", dict(
            mesh="data=2,fsdp=2", per_device=2, resume=os.path.join(out, "checkpoint-2"), **trainer)]}),
    }


class Cases:
    """The batches' results, each batch run when a test first asks for one of its cases: once per test run, in
    whichever pytest process asks first (tests.helpers.made_once: the results are files under the run's directory
    that the other xdist worker reads, waiting while the first runs them), with one seed for the run."""

    def __init__(self):
        seed_dir = made_once("multidevice-seed", lambda p: (p.mkdir(), (p / "seed").write_text(
            str(fresh_seed("multi-device cases")))))
        self.seed = int((seed_dir / "seed").read_text())
        self.out = str(made_once("multidevice-out", lambda p: p.mkdir()))  # the trainers' checkpoints
        self.batches, self.results = _batches(self.out), {}

    def _run_batch(self, path, label: str) -> None:
        """Run batch `label` and write each case's result line (or its error) to path/results.json."""
        devices, batch = self.batches[label]
        results = {case: {"error": f"the {label} batch did not finish"} for case in batch}
        lines, log = _run_cases(["batch", str(self.seed), json.dumps(batch)], devices, 2400)
        results.update({case: {"error": f"no result from the {label} batch, {log}"} for case in batch})
        results.update({line.pop("name"): line for line in map(json.loads, lines)})
        path.mkdir()
        (path / "results.json").write_text(json.dumps(results))

    def __call__(self, name: str) -> dict:
        """Case `name`'s result; fails the asking test with the case's traceback, or the process's log."""
        print(f"multi-device cases seed = {self.seed}  (replay with UNSLOTH_JAX_TEST_SEED={self.seed})")
        for i, label in enumerate(self.batches):  # in order: the resumed trainer reads a checkpoint
            if name in self.results:
                break
            path = made_once(f"multidevice-batch-{i}", lambda p, label=label: self._run_batch(p, label))
            self.results.update(json.loads((path / "results.json").read_text()))
        line = self.results[name]
        if "error" in line:
            pytest.fail(f"case {name} failed:\n{line['error']}", pytrace=False)
        return line["result"]


@pytest.fixture(scope="module")
def cases() -> Cases:
    """Cases(name): a multi-device case's result (one fresh seed for all of them, printed by each test)."""
    return Cases()




# ---------------------------------------------------------------------------------- in this process
def test_parse_mesh():
    assert distributed.parse_mesh("data=2,fsdp=4") == {"data": 2, "fsdp": 4}
    assert distributed.parse_mesh(" fsdp=8 ") == {"fsdp": 8}
    assert distributed.parse_mesh("data=-1,fsdp=2") == {"data": -1, "fsdp": 2}
    for bad, words in (("data=2,tp=2", "'tp=2'"), ("data=two", "data='two' is not an integer"),
                       ("data=0", "positive"), ("data=2,data=4", "given twice"), ("", "give data=N"),
                       ("data", "'data'")):
        with pytest.raises(ValueError) as err:
            distributed.parse_mesh(bad)
        assert "--mesh" in str(err.value) and words in str(err.value), str(err.value)


def test_make_mesh_checks_the_device_count():
    dev = jax.devices()[0]
    eight = [dev] * 8  # the arithmetic is checked before any Mesh is built
    with pytest.raises(ValueError, match=r"fsdp=3 does not divide the 8 devices"):
        distributed.make_mesh(fsdp=3, devices=eight)
    with pytest.raises(ValueError, match=r"data=3 does not divide the 8 devices"):
        distributed.make_mesh(data=3, fsdp=-1, devices=eight)
    with pytest.raises(ValueError, match=r"data=2 x fsdp=2 = 4 devices, but 8 are available"):
        distributed.make_mesh(data=2, fsdp=2, devices=eight)
    with pytest.raises(ValueError, match="at most one"):
        distributed.make_mesh(data=-1, fsdp=-1, devices=eight)
    with pytest.raises(ValueError, match="data must be >= 1"):
        distributed.make_mesh(data=0, devices=eight)
    with pytest.raises(TypeError, match="fsdp must be an integer"):
        distributed.make_mesh(fsdp="2", devices=eight)
    mesh = distributed.make_mesh()
    assert mesh.axis_names == ("data", "fsdp") and mesh.devices.size == jax.device_count()
    assert distributed.resolve_mesh({"fsdp": 1}).shape == mesh.shape
    with pytest.raises(ValueError, match="TrainingArguments.mesh"):
        distributed.resolve_mesh("data=x", "TrainingArguments.mesh")
    with pytest.raises(TypeError, match="mesh must be"):
        distributed.resolve_mesh(8)


def test_leaf_spec_rules(rng):
    fsdp = 8
    layer_path = (jax.tree_util.DictKey("model"), jax.tree_util.DictKey("layers"), jax.tree_util.DictKey("w"))
    flat_path = (jax.tree_util.DictKey("lm_head"),)
    # the stacked layer axis (0) is never split, even when it is the largest divisible one
    assert distributed.leaf_spec(layer_path, (64, 16, 24), 2, fsdp, 0) == P(None, None, "fsdp")
    assert distributed.leaf_spec(layer_path, (64, 24, 16), 2, fsdp, 0) == P(None, "fsdp", None)
    assert distributed.leaf_spec(layer_path, (64, 7, 9), 2, fsdp, 0) == P()  # nothing divisible
    assert distributed.leaf_spec(flat_path, (4096, 128), 2, fsdp, 0) == P("fsdp", None)
    # small leaves stay whole; one device along fsdp means nothing to split
    assert distributed.leaf_spec(flat_path, (16, 8), 4, fsdp, 4096) == P()
    assert distributed.leaf_spec(flat_path, (32, 32), 4, fsdp, 4096) == P("fsdp", None)
    assert distributed.leaf_spec(flat_path, (4096, 128), 2, 1, 0) == P()
    n = int(rng.integers(1, 5)) * fsdp
    assert distributed.leaf_spec(flat_path, (3, n), 4, fsdp, 0) == P(None, "fsdp")


def test_loader_rows_are_a_slice_of_the_whole_batch(rng):
    examples = [{"input_ids": rng.integers(1, 100, int(rng.integers(3, 90))).tolist()} for _ in range(40)]
    loader = DataLoader(examples, batch_size=8, max_seq_length=128, pad_token_id=0, seed=int(rng.integers(1 << 30)))
    for index in range(len(loader)):
        whole = loader.batch(1, index)
        for rows in (slice(0, 4), slice(4, 8), slice(2, 6)):
            part = loader.batch(1, index, rows)
            for key in whole:  # same S (the whole batch's bucket), same rows
                np.testing.assert_array_equal(part[key], whole[key][rows])


def test_host_rows_and_global_batch_on_one_process(rng):
    mesh = distributed.make_mesh()
    rows = 4 * distributed.batch_shards(mesh)
    assert distributed.host_rows(mesh, rows) == slice(0, rows)
    local = {"input_ids": rng.integers(0, 9, (2, rows, 5)).astype(np.int32)}
    batch = distributed.global_batch(mesh, local, rows)
    np.testing.assert_array_equal(np.asarray(batch["input_ids"]), local["input_ids"])
    assert batch["input_ids"].sharding.spec == P(None, ("data", "fsdp"), None)


def test_initialize_is_a_no_op_for_one_process_and_checks_its_arguments(monkeypatch):
    for name in (distributed.ENV_ADDRESS, distributed.ENV_COUNT, distributed.ENV_ID, "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is False
    with pytest.raises(ValueError, match="missing: num_processes, process_id"):
        distributed.initialize(coordinator_address="localhost:1234")
    monkeypatch.setenv(distributed.ENV_COUNT, "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        distributed.initialize(coordinator_address="localhost:1234", process_id=0)
    monkeypatch.setenv(distributed.ENV_COUNT, "2")
    with pytest.raises(ValueError, match="process_id must be <= 1"):
        distributed.initialize(coordinator_address="localhost:1234", process_id=2)


def test_cli_mesh_flag_is_validated(capsys):
    from unsloth_jax import cli

    with pytest.raises(SystemExit) as err:
        cli.build_parser().parse_args(["train", "--mesh", "data=2,fsdp=four"])
    assert err.value.code == 2
    assert "--mesh='data=2,fsdp=four': fsdp='four' is not an integer" in capsys.readouterr().err
    # well-formed, but the product does not match this process's devices: exit 2 before any model loads
    n = jax.device_count()
    assert cli.main(["train", "--mesh", f"data={n + 1}", "--output_dir", os.devnull]) == 2
    assert f"data={n + 1} x fsdp=1 = {n + 1} devices, but {n} are available" in capsys.readouterr().err


# ------------------------------------------------------------------------------ several CPU devices
@pytest.mark.parametrize("kind,remat", [("lora", "full"), ("qlora", "full"), ("qlora", "offload")])
def test_sharded_step_equals_single_device(kind, remat, cases):
    """Data-only (8x1), fsdp-only (1x8) and mixed (2x4) meshes: two steps of 2 accumulated micro-batches give
    the single-device losses, gradient norms and updated LoRA leaves (SGD, so the update is the gradient's);
    also with the sharded steps under "offload" (the custom-VJP layer scan) against the single-device "full"."""
    result = cases(f"equal_{kind}_{remat}")
    for mesh in ("data=8,fsdp=1", "data=1,fsdp=8", "data=2,fsdp=4"):
        r = result[mesh]
        assert r["loss_relerr"] < TOL and r["grad_norm_relerr"] < TOL and r["param_relerr"] < TOL, (mesh, r)
        assert r["param_change"] > 100 * TOL, r  # the steps moved every leaf far more than the tolerance


def test_moe_sharded_step_equals_single_device(cases):
    """A Qwen3-MoE (LoRA on q/v and the experts, the load-balancing loss, a dense layer and a tail scan) on a
    data-only (4x1) and a mixed (2x2) mesh: two steps give the single-device losses, aux losses and leaves."""
    result = cases("moe")
    for mesh in ("data=4,fsdp=1", "data=2,fsdp=2"):
        r = result[mesh]
        assert r["loss_relerr"] < TOL and r["aux_relerr"] < TOL and r["param_relerr"] < TOL, (mesh, r)


def test_dpo_and_grpo_steps_on_a_mesh_equal_single_device(cases):
    """The preference and RL steps come from the same step factory as SFT's, so they run on a mesh too: a DPO
    step (reference = the base) on a data=2 mesh and a GRPO step (clipped ratio, KL) on an fsdp=2 mesh, two
    micro-batches each, give the single-device metrics and updated LoRA leaves (SGD: the update is the gradient)."""
    result = cases("rl_steps")
    for kind in ("dpo", "grpo"):
        r = result[kind]
        assert r["param_change"] > 100 * TOL, r  # the step moved every leaf
        assert r["metric_relerr"] < 1e-4 and r["param_relerr"] < TOL, (kind, r)


def test_dpo_trainer_on_a_mesh_equals_single_device(cases):
    """DPOTrainer(args=DPOConfig(mesh="data=1,fsdp=2")) with 2 pairs per device logs the losses and margins of
    4 pairs per step on one device, and its LoRA leaves live on both devices."""
    result = cases("dpo_trainer")
    mesh, single = result["mesh"], result["single"]
    assert len(mesh["losses"]) == 3 and mesh["devices"] == [2] and single["devices"] == [1], result
    np.testing.assert_allclose(mesh["losses"], single["losses"], rtol=1e-4)
    np.testing.assert_allclose(mesh["margins"], single["margins"], rtol=1e-3, atol=1e-6)
    assert abs(single["margins"][-1]) > 1e-3, result  # the steps moved the policy away from the reference


def test_grpo_trainer_on_a_mesh_equals_single_device(cases):
    """GRPOTrainer(args=GRPOConfig(mesh="data=1,fsdp=2")) with 2 completions per device: the same completions
    (rollouts on one device with the weights the mesh trained), losses and KL as 4 per step on one device; the
    model's LoRA weights come back to its own device (where the engine generates)."""
    result = cases("grpo_trainer")
    mesh, single = result["mesh"], result["single"]
    assert len(mesh["losses"]) == 3 and len(mesh["completions"]) == 2, result  # steps 1 and 3 generate
    assert mesh["completions"] == single["completions"] and mesh["rewards"] == single["rewards"], result
    np.testing.assert_allclose(mesh["losses"], single["losses"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(mesh["kl"], single["kl"], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(mesh["lora_sample"], single["lora_sample"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(mesh["lora_norm"], single["lora_norm"], rtol=1e-5)
    assert single["kl"][1] > 1e-3 and mesh["devices"] == single["devices"] == [1], result
    assert mesh["with_frozen"] and single["with_frozen"], result  # trained weights beside the frozen ones


def test_vision_sft_trainer_on_a_mesh_equals_single_device(cases):
    """SFTTrainer with UnslothVisionDataCollator (LoRA on both towers) on a mesh: Gemma 3 on data=2 and
    Qwen2.5-VL on fsdp=2, one row per device, log the losses and grad norms of two rows per step on one device
    (the images go whole to every device; the text rows split)."""
    for family, result in cases("vision_trainer").items():
        mesh, single = result["mesh"], result["single"]
        assert len(mesh["losses"]) == 2 and mesh["devices"] == [2] and single["devices"] == [1], (family, result)
        np.testing.assert_allclose(mesh["losses"], single["losses"], rtol=1e-4, err_msg=family)
        np.testing.assert_allclose(mesh["grad_norms"], single["grad_norms"], rtol=1e-3, err_msg=family)
        assert single["losses"][-1] < single["losses"][0], (family, result)


def test_fsdp8_weights_live_in_8_shards_and_are_gathered_layer_by_layer(cases):
    result = cases("fsdp_shards")
    for kind, r in result.items():
        sharded = 0
        for leaf in r["leaves"]:
            assert leaf["reassembled"], leaf
            assert leaf["devices"] == 8
            big = leaf["bytes"] >= distributed.MIN_SHARD_BYTES
            axes = [a for a in range(1 if leaf["stacked"] else 0, len(leaf["shape"])) if leaf["shape"][a] % 8 == 0]
            if big and axes:
                sharded += 1
                assert "fsdp" in leaf["spec"], leaf
                assert leaf["shard_elems_total"] == leaf["elems"], leaf  # each element on exactly one device
                (shard_shape,) = leaf["distinct_shard_shapes"]
                assert int(np.prod(shard_shape)) * 8 == leaf["elems"], leaf
            else:
                assert leaf["spec"] == "P()", leaf
        assert sharded >= 9, (kind, sharded)  # embeddings, lm_head and the 7 projections of the layers
        # the compiled step: one layer's slice gathered inside the layer loop (forward and recomputation),
        # never a whole stacked weight, never the batch-sharded activations
        assert r["whole_stack_gathers"] == [], r["whole_stack_gathers"]
        assert r["layer_gathers_outside_loop"] == 0
        assert r["layer_gathers_in_loop"] >= 2 * r["sharded_stacked_leaves"] >= 14, r
        assert r["activation_gathers"] == [], r["activation_gathers"]
        if kind == "qlora":
            assert r["dense_projection_gathers"] == [], "a 4-bit weight was gathered dequantized"


def test_pallas_kernels_run_per_batch_shard(cases):
    """With every kernel forced to Pallas (interpret mode on the CPU) the QLoRA step on a 2x4 mesh runs them
    in shard_map over the batch and matches one device."""
    from unsloth_jax import ops

    r = cases("pallas_on_mesh")
    kernels = {op: impl for op, impl in r["chosen"].items() if op in ops.KERNEL_OPS}
    assert set(kernels.values()) == {"pallas"} and r["chosen"]["nf4_gemm"] == "dequantized", r["chosen"]
    assert r["manual_regions"] > 0
    assert r["loss_relerr"] < TOL and r["param_relerr"] < TOL, r


def test_checkpoint_saved_on_8_devices_restores_on_4(cases):
    """SFTTrainer on fsdp=8 saves at step 2 (LoRA leaves and optimizer state split 8 ways); a 4-device process
    resumes on data=2 x fsdp=2 and its steps 3-4 give the uninterrupted 8-device run's losses."""
    full = cases("trainer_fsdp8")
    assert all(x["devices"] == 8 and "fsdp" in x["spec"] for x in full["trainable"]), full["trainable"]
    resumed = cases("trainer_resumed")
    assert resumed["devices"] == 4
    assert all(x["devices"] == 4 and "fsdp" in x["spec"] for x in resumed["trainable"]), resumed["trainable"]
    assert len(resumed["losses"]) == 4
    np.testing.assert_allclose(resumed["losses"][2:], full["losses"][2:], rtol=TOL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_give_one_process_losses(seed, tmp_path):
    """`unsloth-jax train --mesh data=4,fsdp=2` as two jax.distributed processes of 4 CPU devices each (gloo
    collectives) against one process of 8 devices and against one device: the same losses; only process 0
    writes metrics, the summary and the adapter; the checkpoint is written once by both."""
    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta mesh shard device token layer scan".split()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(5, 30))))}) + "\n"
                            for _ in range(40)))
    common = [sys.executable, "-m", "unsloth_jax.cli", "train", "--dataset", str(data), "--max_steps", "3",
              "--max_seq_length", "64", "--optim", "adamw_torch", "--logging_steps", "1", "--seed", str(seed % 10000),
              # 2 micro-batches per step, not the CLI's 4: each costs the two processes a round of gloo collectives
              "--gradient_accumulation_steps", "2"]

    def launch(out, devices, extra):
        env = subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(devices))
        # no shared on-disk compile cache (tests/conftest.py): two jax.distributed processes sharing it hung at
        # their shutdown barrier
        env = {k: v for k, v in env.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
        return subprocess.Popen(common + ["--output_dir", str(out)] + extra, cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    port = _free_port()
    two = [launch(tmp_path / "two", 4, ["--per_device_train_batch_size", "1", "--mesh", "data=4,fsdp=2",
                                        "--save_steps", "2", "--coordinator_address", f"localhost:{port}",
                                        "--num_processes", "2", "--process_id", str(i)]) for i in range(2)]
    logs = [p.communicate(timeout=1200)[0] for p in two]
    for p, log in zip(two, logs):
        assert p.returncode == 0, log[-5000:]
    for name, devices, extra in (("one", 8, ["--per_device_train_batch_size", "1", "--mesh", "data=4,fsdp=2"]),
                                 ("single", 1, ["--per_device_train_batch_size", "8"])):
        p = launch(tmp_path / name, devices, extra + ["--no-save_model"])
        log = p.communicate(timeout=1200)[0]
        assert p.returncode == 0, log[-5000:]

    def losses(name):
        return [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("two")) == 3  # written once, by process 0
    np.testing.assert_allclose(losses("two"), losses("one"), rtol=TOL)
    np.testing.assert_allclose(losses("two"), losses("single"), rtol=TOL)
    assert "mesh data=4 x fsdp=2 (8 cpu devices, 2 processes)" in logs[0]
    assert "unsloth-jax: 3 steps" not in logs[1] and "saved LoRA adapter" not in logs[1]
    assert (tmp_path / "two" / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "two" / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2


def test_memory_per_device_falls_as_fsdp_grows(cases):
    """compiled.memory_analysis() of the step on 8 CPU devices (data = 8 / fsdp, one row per device): the
    bytes per device fall at every doubling of fsdp, LoRA and QLoRA (BENCHMARKS.md has the table)."""
    rows = cases("memory")
    for kind in ("lora", "qlora"):
        per_device = [r["per_device"] for r in rows if r["kind"] == kind]
        assert len(per_device) == 4 and all(a > b for a, b in zip(per_device, per_device[1:])), (kind, per_device)


def test_multi_gpu_bench_runs_on_the_cpu(tmp_path):
    """bench/multi_gpu.py with tiny shapes on forced CPU devices: 1 device and fsdp=2 train the same steps."""
    from tests.helpers import TINY_MODEL

    cmd = [sys.executable, "bench/multi_gpu.py", str(TINY_MODEL), "--cpu-devices", "2", "--gpus", "1,2",
           "--methods", "lora", "--strategies", "fsdp", "--steps", "2", "--warmup", "1", "--seq", "32"]
    env = subprocess_env(XLA_FLAGS=QUICK_COMPILE)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    runs = [x for x in lines if x["name"] == "multi_gpu"]
    summary = [x for x in lines if x["name"] == "multi_gpu_summary"]
    assert [(x["strategy"], x["gpus"]) for x in runs] == [("single", 1), ("fsdp", 2)], lines
    assert runs[1]["accumulation"] == 1 and runs[0]["accumulation"] == 2 and runs[0]["rows_per_step"] == 2
    assert summary[1]["max_loss_relerr_vs_1gpu"] < TOL and summary[1]["steps_compared"] == 2, summary
    assert summary[1]["scaling_efficiency"] > 0 and summary[1]["step_program_gib_per_device"] > 0
    assert runs[1]["nccl_nvls_enable"] == "0"
