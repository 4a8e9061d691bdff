"""The DeepSpeed API surface and launcher flags real scripts use (issue 12, sections 2-5).

The multi-rank tests run tests/workers/ds_style_train.py, written the way DeepSpeedExamples'
scripts are, under the launcher with 2 ranks at every ZeRO stage; the rest are in-process.
"""

from __future__ import annotations

import base64
import ctypes.util
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import autotuner
from autotuner.app.cli import main
from autotuner.core.errors import ConfigError, UnsupportedError, UsageError
from autotuner.launch import LaunchOptions, build_plan
from autotuner.launch.core_binding import cores_for_ranks, one_cpu_per_core
from autotuner.launch.numa import memory_policy_for, numa_node_cpus
from autotuner.launch.resources import parse_core_list, select_slots
from conftest import ROOT, TOY, WORKERS, launcher_env, run_launcher

DS_STYLE = WORKERS / "ds_style_train.py"
CLIENT_WINS = "using the optimizer passed to initialize()"


def ds_config(tmp_path: Path, stage: int, **extra) -> Path:
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.5}},  # not used: the script passes FusedAdam
              "zero_optimization": {"stage": stage}, "comet": {"enabled": False}, **extra}
    path = tmp_path / f"ds_stage{stage}.json"
    path.write_text(json.dumps(config))
    return path


def numa_maps_policy(policy) -> str:
    """How /proc/self/numa_maps writes a memory policy: 'default', 'bind:0-1', 'prefer:2'."""
    if policy is None:
        return "default"
    spans, nodes = [], list(policy.nodes)
    while nodes:
        end = 0
        while end + 1 < len(nodes) and nodes[end + 1] == nodes[end] + 1:
            end += 1
        spans.append(f"{nodes[0]}-{nodes[end]}" if end else f"{nodes[0]}")
        nodes = nodes[end + 1:]
    return f"{policy.mode}:{','.join(spans)}"


def write_script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


ECHO = """
import json, os, sys
from pathlib import Path
out = Path(os.environ["ECHO_DIR"]) / f"rank{os.environ['RANK']}.json"
out.write_text(json.dumps({"argv": sys.argv[1:], "cores": sorted(os.sched_getaffinity(0)),
                           "omp": os.environ.get("OMP_NUM_THREADS"), "local_size": os.environ.get("LOCAL_SIZE"),
                           "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                           "memory_policy": open("/proc/self/numa_maps").readline().split()[1]}))
print(f"hello from rank {os.environ['RANK']}", flush=True)
"""


def run_echo(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[object, list[dict]]:
    script = write_script(tmp_path, "echo.py", ECHO)
    echo_dir = tmp_path / "echo"
    echo_dir.mkdir(exist_ok=True)
    result = run_launcher(*flags, script, "user_arg", timeout=120,
                          env={**launcher_env(), **(env or {}), "ECHO_DIR": str(echo_dir)})
    ranks = [json.loads(p.read_text()) for p in sorted(echo_dir.glob("rank*.json"))]
    return result, ranks


KMP_AFFINITY = "granularity=fine,compact"
# Echo launches that two tests each read: (flags, environment). What a launch shows does not depend
# on which test started it, so each starts once (a launch costs ~7 s here).
SHARED_ECHO = {
    # --include picks the rank count; each rank gets --local_rank after the script.
    "include": (("--include", "localhost:0,1"), {}),
    # PET_NPROC_PER_NODE stands in for --nproc_per_node; --no_local_rank passes none.
    "pet_no_local_rank": (("--no_local_rank",), {"PET_NPROC_PER_NODE": "2"}),
    # The flag beats PET_NPROC_PER_NODE; KMP_AFFINITY without --bind_cores_to_rank is the user's own.
    "flag_over_pet_kmp_unbound": (("--nproc_per_node", "1"),
                                  {"PET_NPROC_PER_NODE": "3", "KMP_AFFINITY": KMP_AFFINITY}),
}


@pytest.fixture(scope="module")
def shared_echo(tmp_path_factory):
    """shared_echo(name): SHARED_ECHO[name]'s (launch, ranks), launched when a test first asks for it."""
    launched = {}

    def launch(name: str) -> tuple[object, list[dict]]:
        if name not in launched:
            flags, env = SHARED_ECHO[name]
            launched[name] = run_echo(tmp_path_factory.mktemp(name), *flags, env=env)
        return launched[name]

    return launch


# ----- a DeepSpeedExamples-style script, import changed only, at every stage -----
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_style_script_trains_alike_at_every_stage(tmp_path, no_orphans):
    seen = {}
    for stage in (0, 1, 2, 3):
        out = tmp_path / f"seen{stage}.json"
        # Stage 0 declares --local_rank after add_config_arguments, the others before: both must parse.
        order = ("--local_rank_after",) if stage == 0 else ()
        config = ds_config(tmp_path, stage)
        if stage == 3:  # base64-encoded, as DeepSpeed and the Trainer also read `--deepspeed`: read at its stage
            config = base64.urlsafe_b64encode(config.read_bytes()).decode()
        result = run_launcher("--nproc_per_node", "2", DS_STYLE, *order, "--steps", "6", "--out", out,
                              "--deepspeed", config, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stderr.count(CLIENT_WINS) == 1, result.stderr  # once per job, not per rank
        assert result.stderr.count("accepted but not used") == 1, result.stderr
        seen[stage] = json.loads(out.read_text())
    for stage, run in seen.items():
        assert run["stage"] == stage and run["world_size"] == 2
        assert run["local_rank_arg"] == run["local_rank_env"] == run["comm_local_rank"] == 0
        assert run["scheduler"] == "StepLR" and run["loader_batch"] == 8  # positional training_data, lr_scheduler
        assert run["module_is_model"] and not run["fp16"] and not run["bf16"]
        assert run["step_applied"] == [True] * 6 and len(run["grad_norms"]) == 6
        assert run["lr"] == [pytest.approx(1e-2 * 0.5 ** 3)]  # FusedAdam's lr, StepLR halving every 2 steps
        assert run["device_name"] == "cpu" and run["device_count"] == 2 and run["is_available"]
        assert run["max_memory_allocated"] >= run["memory_allocated"] > 0
        # Same data, same client optimizer: every stage trains the same numbers.
        assert run["losses"] == pytest.approx(seen[0]["losses"], rel=1e-5)
        assert run["grad_norms"] == pytest.approx(seen[0]["grad_norms"], rel=1e-5)
    assert seen[0]["losses"][-1] < seen[0]["losses"][0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_style_script_tunes_and_the_optimal_config_keeps_the_users_keys(tmp_path, no_orphans):
    # The config goes in base64-encoded, as DeepSpeed and the Trainer also read `--deepspeed`.
    config = ds_config(tmp_path, 0, zero_optimization={"stage": [0, 3]}, train_micro_batch_size_per_gpu=[4, 8],
                       gradient_accumulation_steps=None,
                       autotuning={"enabled": True, "fast": True, "start_profile_step": 2, "end_profile_step": 4,
                                   "model_info": {"num_params": 600}, "results_dir": str(tmp_path / "results"),
                                   "exps_dir": str(tmp_path / "exps")})
    raw = json.loads(config.read_text())
    del raw["gradient_accumulation_steps"]
    encoded = base64.urlsafe_b64encode(json.dumps(raw).encode()).decode()
    result = run_launcher("--autotuning", "tune", "--nproc_per_node", "2", DS_STYLE, "--steps", "6",
                          "--deepspeed", encoded, timeout=500, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "best_metric_val (samples/s)" in result.stdout
    assert encoded not in result.stderr  # messages name it "the base64-encoded config"
    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert optimal["comet"] == {"enabled": False}  # a DeepSpeed key we accept but do not act on stays
    assert optimal["optimizer"] == raw["optimizer"] and "autotuning" not in optimal
    assert optimal["zero_optimization"]["stage"] in (0, 3)
    assert optimal["train_micro_batch_size_per_gpu"] in (4, 8)
    # The ranks read a base64 config too, at the stage it names: test_deepspeed_style_script_trains_alike_
    # at_every_stage trains stage 3 from one (a launch of its own here cost ~9 s).


# ----- the launcher's --local_rank and the deepspeed launcher's flags -----
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_rank_is_passed_after_the_script_unless_no_local_rank(shared_echo, no_orphans):
    # 2 ranks from --include, then from PET_NPROC_PER_NODE: the launches the tests of those read.
    result, ranks = shared_echo("include")
    assert result.returncode == 0, result.stderr
    assert [r["argv"] for r in ranks] == [["--local_rank=0", "user_arg"], ["--local_rank=1", "user_arg"]]
    assert {r["local_size"] for r in ranks} == {"2"}
    result, ranks = shared_echo("pet_no_local_rank")
    assert result.returncode == 0, result.stderr
    assert [r["argv"] for r in ranks] == [["user_arg"], ["user_arg"]]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to give each rank its own")
def test_bind_cores_to_rank_pins_each_rank_and_each_rank_log(tmp_path, no_orphans):
    logs = tmp_path / "rank_logs"
    result, ranks = run_echo(tmp_path, "--nproc_per_node", "2", "--bind_cores_to_rank", "--enable_each_rank_log", logs)
    assert result.returncode == 0, result.stderr
    allowed = sorted(os.sched_getaffinity(0))
    share = len(allowed) // 2
    assert [r["cores"] for r in ranks] == [allowed[:share], allowed[share:2 * share]]
    assert {r["omp"] for r in ranks} == {str(share)}
    # Each rank's memory by the NUMA layout, as DeepSpeed's numactl prefix (with libnuma): on this
    # machine's nodes, as /proc/self/numa_maps writes the policy.
    numa = numa_node_cpus()
    if ctypes.util.find_library("numa"):
        expected = [memory_policy_for(r["cores"], numa) for r in ranks]
        assert [r["memory_policy"] for r in ranks] == [numa_maps_policy(p) for p in expected]
    else:
        assert "libnuma not found, so each rank's memory is not bound" in result.stderr
    files = sorted(logs.glob("*_rank*.log"))
    # As DeepSpeed's launcher: <its start time>_rank<N>.log, one time for every rank.
    assert [f.name.rsplit("_", 1)[1] for f in files] == ["rank0.log", "rank1.log"]
    assert len({f.name.rsplit("_", 1)[0] for f in files}) == 1 and re.fullmatch(r"\d{14}", files[0].name[:14])
    assert "hello from rank 1" in files[1].read_text() and "hello from rank" not in result.stdout
    # Opened for writing, as DeepSpeed does: a log of the same name starts over.
    from autotuner.launch.rank_entry import LOG_PREFIX_ENV

    files[0].write_text("an earlier run\n" * 100)
    prefix = files[0].name.rsplit("_", 1)[0]
    subprocess.run([sys.executable, "-m", "autotuner.launch.rank_entry", "--log_dir", str(logs), "--",
                    sys.executable, "-c", "print('this run')"], check=True, timeout=60,
                   env={**os.environ, LOG_PREFIX_ENV: prefix, "RANK": "0"})
    assert files[0].read_text() == "this run\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_include_and_a_hostfile_naming_this_host_pick_the_rank_count(tmp_path, shared_echo, no_orphans):
    result, ranks = shared_echo("include")
    assert result.returncode == 0, result.stderr
    assert len(ranks) == 2
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one node\nlocalhost slots=2\n")
    result, ranks = run_echo(tmp_path, "--hostfile", hostfile)
    assert result.returncode == 0, result.stderr
    assert len(ranks) == 2


# The launcher, with DeepSpeed's default hostfile (/job/hostfile) moved to argv[1] for the test.
AT_DEFAULT_HOSTFILE = """
import runpy, sys
import autotuner.launch.resources as resources
resources.DEFAULT_HOSTFILE = sys.argv.pop(1)
runpy.run_module("autotuner", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.is_available(), reason="counts CPU ranks (one by default)")
def test_deepspeeds_default_hostfile_is_read_where_it_exists(tmp_path, no_orphans):
    script = write_script(tmp_path, "echo.py", ECHO)
    default = tmp_path / "job_hostfile"

    def launch(*flags):
        echo_dir = tmp_path / f"echo{len(list(tmp_path.glob('echo*')))}"
        echo_dir.mkdir()
        result = subprocess.run([sys.executable, "-c", AT_DEFAULT_HOSTFILE, str(default), *flags, script],
                                cwd=ROOT, env={**launcher_env(), "ECHO_DIR": str(echo_dir)}, capture_output=True,
                                text=True, timeout=120)
        return result, len(list(echo_dir.glob("rank*.json")))

    result, ranks = launch()  # none there: this node's default, as DeepSpeed
    assert result.returncode == 0 and ranks == 1 and "hostfile" not in result.stderr, result.stderr
    default.write_text("localhost slots=2\n")
    result, ranks = launch()
    assert result.returncode == 0 and ranks == 2, result.stderr
    assert f"reading DeepSpeed's default {default}" in result.stderr
    # A command that starts one node itself (torchrun's way) is not given the hostfile's hosts.
    result, ranks = launch("--master_addr", "127.0.0.1")
    assert result.returncode == 0 and ranks == 1 and "hostfile" not in result.stderr, result.stderr


def test_torchruns_pet_variables_stand_in_for_its_flags(tmp_path, monkeypatch, shared_echo):
    # Kubeflow's PyTorchJob passes torchrun's flags as PET_<FLAG>; each pod trained alone here.
    result, ranks = shared_echo("pet_no_local_rank")  # PET_NPROC_PER_NODE=2
    assert result.returncode == 0, result.stderr
    assert len(ranks) == 2 and {r["local_size"] for r in ranks} == {"2"}
    result, ranks = shared_echo("flag_over_pet_kmp_unbound")  # PET_NPROC_PER_NODE=3 and --nproc_per_node 1
    assert result.returncode == 0 and len(ranks) == 1, result.stderr  # the flag wins, as in torchrun
    # Read once: the launchers this one starts (a tune's experiments, other nodes') see them no more.
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    script = write_script(tmp_path, "echo.py", ECHO)
    main(["--rdzv_backend", "static", str(script)])  # refused after parsing
    assert "PET_NPROC_PER_NODE" not in os.environ


@pytest.mark.parametrize("flags, fragment", [
    (("--include", "localhost:0", "--nproc_per_node", "2"), "--include/--exclude choose the devices themselves"),
    (("--include", "localhost:0", "--exclude", "localhost:1"), "mutually exclusive"),
    (("--include", "nohost:0"), "host 'nohost' is not in the resource pool"),
    (("--force_multi",), "--force_multi"),
    # DeepSpeed's --no_ssh was read as an abbreviation of our --no_ssh_check: node 0 then started
    # every host over ssh. Refused, and no flag is taken by a prefix.
    (("--no_ssh", "--node_rank", "0"), "--no_ssh: DeepSpeed's start of this node alone"),
    (("--no_ssh_ch",), "unrecognized arguments: --no_ssh_ch"),
    (("--rdzv_backend", "static"), "--rdzv_backend static: only with --rdzv_endpoint"),
    (("--launcher", "slurmx"), "--launcher: got 'slurmx'"),
    (("--bind_core_list", "0"), "--bind_core_list: needs --bind_cores_to_rank"),
    (("--bind_cores_to_rank", "--bind_core_list", "3-1"), "--bind_core_list: got '3-1'"),
    (("--bind_cores_to_rank", "--nproc_per_node", "64"), "each rank needs at least one"),
])
def test_launcher_flag_misuse_is_one_line(tmp_path, capsys, flags, fragment):
    script = write_script(tmp_path, "echo.py", ECHO)
    code = main([*flags, str(script)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and fragment in err, err


def test_bind_cores_to_rank_refuses_kmp_affinity_as_deepspeed_does(tmp_path, shared_echo, no_orphans):
    script = write_script(tmp_path, "echo.py", ECHO)
    # A real launcher process: one run in this one would leave its environment (the launcher's
    # settings for its ranks) to every later test's launcher.
    env = {**launcher_env(), "KMP_AFFINITY": KMP_AFFINITY, "ECHO_DIR": str(tmp_path)}
    refused = run_launcher("--nproc_per_node", "1", "--bind_cores_to_rank", script, env=env)
    assert refused.returncode == 2, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "KMP_AFFINITY is set" in refused.stderr, refused.stderr
    # Without binding it is the user's own setting: a launch with KMP_AFFINITY set (the PET test's too).
    unbound, _ = shared_echo("flag_over_pet_kmp_unbound")
    assert unbound.returncode == 0, unbound.stderr


def test_hostfile_with_unreachable_hosts_or_bad_lines_is_refused(tmp_path, capsys, monkeypatch):
    script = write_script(tmp_path, "echo.py", ECHO)
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh here: the head cannot start worker-1
    for text, fragment in (("localhost slots=2\nworker-1 slots=2\n", "ssh is not on PATH"),
                           ("localhost slot=2\n", "bad entry"), ("localhost slots=1\nlocalhost slots=1\n", "twice"),
                           ("# nothing\n", "no 'host slots=N' entries")):
        hostfile = tmp_path / "hostfile"
        hostfile.write_text(text)
        assert main(["--hostfile", str(hostfile), str(script)]) == 2
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_resource_filters_follow_deepspeed():
    pool = {"worker-0": 4, "worker-1": 2}
    assert select_slots(pool, "worker-0:0,2@worker-1", None) == {"worker-0": [0, 2], "worker-1": [0, 1]}
    assert select_slots(pool, None, "worker-0:1@worker-1") == {"worker-0": [0, 2, 3]}
    with pytest.raises(UsageError, match="no slot 5"):
        select_slots(pool, "worker-0:5", None)
    assert select_slots({"localhost": 1}, "localhost:0,1", None, check_include_range=False) == {"localhost": [0, 1]}
    assert parse_core_list("0,2-4,7") == [0, 2, 3, 4, 7]
    assert cores_for_ranks([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]  # the remainder stays unused, as in DeepSpeed
    # Without a core list, DeepSpeed divides the physical cores: one hardware thread of each.
    hyperthreaded = {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)}.get  # cpus 0-3 and their siblings 4-7
    assert one_cpu_per_core(list(range(8)), hyperthreaded) == [0, 1, 2, 3]
    assert one_cpu_per_core([2, 3, 5, 6], hyperthreaded) == [2, 3, 5]  # 6 shares a core with 2; 1, 5's sibling, is not ours
    assert one_cpu_per_core([0, 1], {0: "0-1", 1: "0-1"}.get) == [0]
    assert one_cpu_per_core([0, 1], lambda cpu: None) == [0, 1]  # no topology: each CPU a core



@pytest.mark.skipif(not os.path.exists("/proc/self/numa_maps"), reason="needs the kernel's NUMA policy interface")
@pytest.mark.parametrize("policy", ["bind:0", "prefer:0"])
def test_a_rank_runs_its_script_under_its_memory_policy(policy, no_orphans):
    """rank_entry applies the policy, then execs the script: the script's process runs under it."""
    script = "print(open('/proc/self/numa_maps').readline().split()[1])"
    done = subprocess.run([sys.executable, "-m", "autotuner.launch.rank_entry", "--memory_policies", f"{policy};",
                           "--", sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LOCAL_RANK": "0"})
    assert done.returncode == 0, done.stderr
    if "not applied" in done.stderr:  # a kernel or cgroup that refuses NUMA policies says so
        pytest.skip(done.stderr.strip())
    assert done.stdout.strip() == policy


def test_plan_passes_local_rank_macro_and_deepspeed_env(tmp_path):
    script = write_script(tmp_path, "echo.py", ECHO)
    plan = build_plan(LaunchOptions(script=str(script), script_args=("a",), nproc_per_node=2), "python", {})
    assert plan.command == ("python", "-u", "-m", "autotuner.launch.run_script", str(script), "--local_rank=${local_rank}", "a")
    assert plan.env["LOCAL_SIZE"] == "2" and plan.env["CROSS_SIZE"] == "1" and plan.env["CROSS_RANK"] == "0"
    plan = build_plan(LaunchOptions(script=str(script), script_args=("a",), no_local_rank=True), "python", {})
    assert plan.command == ("python", "-u", "-m", "autotuner.launch.run_script", str(script), "a")


# ----- rank-side errors and refused features: one line from the launcher -----
INIT_INFERENCE = """
import atexit, os, pathlib, sys
import torch
import autotuner as deepspeed


class SaysSoAtTeardown:  # as NCCL's process group does when a failed rank's interpreter tears down
    def __del__(self, write=sys.stderr.write):
        write("torn down\\n")


held = SaysSoAtTeardown()
atexit.register(lambda: pathlib.Path(sys.argv[1], f"exit_handlers_ran_{os.environ['RANK']}").touch())
deepspeed.init_distributed()
deepspeed.init_inference(torch.nn.Linear(2, 2))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_unsupported_feature_in_the_ranks_is_one_launcher_line(tmp_path, no_orphans):
    script = write_script(tmp_path, "init_inference.py", INIT_INFERENCE)
    result = run_launcher("--nproc_per_node", "2", "--no_local_rank", script, tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("launcher: error: rank ") and "deepspeed.init_inference is not supported" in lines[0]
    # The script's exit handlers ran in the ranks that failed; the interpreter's teardown did not.
    assert sorted(path.name for path in tmp_path.glob("exit_handlers_ran_*")) == ["exit_handlers_ran_0",
                                                                                 "exit_handlers_ran_1"]
    debug = run_launcher("--debug", "--nproc_per_node", "2", "--no_local_rank", script, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_moe_imports_and_is_refused_only_when_used_and_pipe_is_the_pipeline_module():
    import autotuner.moe.utils
    import autotuner.pipe
    from autotuner.runtime.pipeline.module import PipelineModule

    with pytest.raises(UnsupportedError, match="is not supported by autotuner"):
        autotuner.moe.layer.MoE(hidden_size=8, expert=None, num_experts=2)
    assert autotuner.pipe.PipelineModule is autotuner.PipelineModule is PipelineModule
    with pytest.raises(RuntimeError, match="must provide num_stages or topology"):  # DeepSpeed's words
        autotuner.PipelineModule(layers=[])
    # zero.Init trains as under DeepSpeed: FSDP2 shards the model, built whole, at initialize.
    with autotuner.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        built = torch.nn.Linear(2, 2)
    assert not hasattr(built.weight, "ds_id") and built.weight.shape == (2, 2)
    # Stage 0-2 parameters need no gathering: DeepSpeed-Chat enters this on every path.
    with autotuner.zero.GatheredParameters([torch.nn.Parameter(torch.ones(2))], modifier_rank=0):
        pass


# ----- the Python API, in-process -----
def test_initialize_has_deepspeeds_positional_order():
    names = list(inspect.signature(autotuner.initialize).parameters)
    assert names == ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                     "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                     "config_params"]
    init = inspect.signature(autotuner.init_distributed).parameters
    assert list(init)[:3] == ["dist_backend", "auto_mpi_discovery", "distributed_port"]
    assert init["distributed_port"].default == 29500


class _ModelParallel:
    def get_model_parallel_world_size(self):
        return 2


def test_initialize_refuses_model_parallelism_and_a_missing_group(monkeypatch):
    model = torch.nn.Linear(2, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(UnsupportedError, match="model-parallel world size is 2 but the config.s tensor_parallel.autotp_size gives 1"):
        autotuner.initialize(model=model, mpu=_ModelParallel(), config=config)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="dist_init_required=False"):
        autotuner.initialize(model=model, dist_init_required=False, config=config)


def test_comm_before_init_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(UsageError, match="process group is not initialised"):
        autotuner.comm.get_rank()


def test_cpu_accelerator_answers_like_deepspeeds(monkeypatch):
    from autotuner.runtime.accelerator import CpuAccelerator

    monkeypatch.setenv("LOCAL_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cpu = CpuAccelerator()
    assert (cpu.device_name(), cpu.device_name(2), cpu.device(), cpu.current_device()) == ("cpu", "cpu", None, 1)
    assert cpu.device_count() == 3 and cpu.is_available() and cpu.communication_backend_name() == "gloo"
    assert cpu.max_memory_allocated() >= cpu.memory_allocated() > 0
    cpu.manual_seed(3)
    first = torch.rand(1)
    cpu.manual_seed(3)
    assert torch.equal(first, torch.rand(1))


def test_accelerator_choice_follows_ds_accelerator(monkeypatch):
    from autotuner.runtime import accelerator

    monkeypatch.setattr(accelerator, "_ACCELERATOR", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ConfigError, match="DS_ACCELERATOR: got 'xpu'"):
        accelerator.get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert accelerator.get_accelerator().device_name() == "cpu"


def test_repeating_loader_restarts_and_log_dist_follows_deepspeed(capsys, monkeypatch):
    from autotuner.utils import RepeatingLoader, log_dist

    stream = RepeatingLoader([1, 2])
    assert [next(stream) for _ in range(5)] == [1, 2, 1, 2, 1]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    log_dist("no group yet", level=logging.WARNING)
    assert "[Rank -1] no group yet" in capsys.readouterr().out


def test_fused_adam_is_torchs_adamw_and_refuses_no_bias_correction():
    from autotuner.ops.adam import DeepSpeedCPUAdam, FusedAdam

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(FusedAdam(params, lr=0.1), torch.optim.AdamW)
    assert type(DeepSpeedCPUAdam(params, adamw_mode=False)) is torch.optim.Adam
    with pytest.raises(UnsupportedError, match="bias_correction=False"):
        FusedAdam(params, bias_correction=False)


# ----- configs DeepSpeed accepts, and bad input found before launching -----
def test_arg_mappings_keys_with_spaces_are_stripped(caplog):
    from autotuner.config import load_config

    config = load_config({"autotuning": {"arg_mappings": {"gradient_accumulation_steps ": " --gas"}}})
    assert config.autotuning.arg_mappings == {"gradient_accumulation_steps": "--gas"}
    assert "spaces around it" in caplog.text


def test_the_config_comes_from_where_deepspeed_reads_it(tmp_path):
    import argparse

    def engine_of(**kwargs):
        model = torch.nn.Linear(2, 2)
        return autotuner.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)[0]

    # A script's own --deepspeed PATH beside initialize(config=dict): DeepSpeed never reads
    # args.deepspeed (its --deepspeed is a switch), so the dict is the config.
    engine = engine_of(args=argparse.Namespace(deepspeed=str(tmp_path / "absent.json")),
                       config={"train_micro_batch_size_per_gpu": 3})
    assert engine.train_micro_batch_size_per_gpu() == 3
    # args.deepspeed_config may be a dict or a Path, as DeepSpeed takes them.
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 5}')
    assert engine_of(args=argparse.Namespace(deepspeed_config=path)).train_micro_batch_size_per_gpu() == 5
    assert engine_of(args=argparse.Namespace(deepspeed_config={"train_micro_batch_size_per_gpu": 6})
                     ).train_micro_batch_size_per_gpu() == 6
    # --deepspeed PATH alone (Hugging Face's style) still reads that file.
    assert engine_of(args=argparse.Namespace(deepspeed=str(path))).train_micro_batch_size_per_gpu() == 5
    with pytest.raises(ConfigError, match=r"config given twice: initialize\(config=...\) and --deepspeed_config"):
        engine_of(args=argparse.Namespace(deepspeed_config=str(path)), config={"train_micro_batch_size_per_gpu": 3})


@pytest.mark.parametrize("batch", [{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"},
                                   {"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"}])
def test_a_batch_size_left_auto_is_refused_when_training(batch):
    # DeepSpeed's engine refuses it; filled in here, "auto" accumulation trained as 1.
    key = next(key for key, value in batch.items() if value == "auto")
    with pytest.raises(ConfigError, match=rf'^config: {key} is "auto", which the autotuner .* give a number to train$'):
        autotuner.initialize(model=torch.nn.Linear(2, 2), config=batch)


def test_a_number_beyond_float_is_one_line(tmp_path):
    from autotuner.config import load_config

    path = tmp_path / "big.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2,\n "gradient_clipping": 1e400}')
    with pytest.raises(ConfigError, match=r"big.json:2:23: the number 1e400 is too large"):
        load_config(path)


@pytest.mark.parametrize("params, fragment", [
    ({"lrr": 0.1}, "optimizer.params.lrr: not a parameter of torch.optim.AdamW; did you mean 'lr'?"),
    ({"lr": -1}, "Invalid learning rate: -1"),
])
def test_optimizer_params_are_checked_before_launch(tmp_path, capsys, monkeypatch, params, fragment):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                  "optimizer": {"type": "Adam", "params": {**params, "torch_adam": True}}}))
    for argv in (["--nproc_per_node", "2", str(TOY), "--pid_dir", "pids", "--deepspeed", str(config)],
                 ["--autotuning", "tune", "--nproc_per_node", "2", str(TOY), "--pid_dir", "pids", "--deepspeed",
                  str(config)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("launcher: error: ") and fragment in err[-1], err
        assert not (tmp_path / "pids").exists()


def test_max_train_batch_size_below_the_ranks_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                  "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                                  "autotuning": {"enabled": True, "max_train_batch_size": 1}}))
    assert main(["--autotuning", "tune", "--nproc_per_node", "2", str(TOY), "--deepspeed", str(config)]) == 2
    err = capsys.readouterr().err
    assert "max_train_batch_size (1): no micro-batch size gives a valid global batch" in err
    assert "smallest global batch is 2" in err and not (tmp_path / "autotuning_exps").exists()


def test_cpu_offload_on_a_cpu_machine_is_dropped_with_a_warning(capsys):
    from autotuner.config.models import ZeroConfig
    from autotuner.runtime.training.sharding import settle_offload

    zero = ZeroConfig(stage=1, offload_optimizer={"device": "cpu"})
    settled = settle_offload(zero, 1, torch.device("cpu"))
    assert settled.offload_optimizer is None
    assert "this machine has no GPU" in capsys.readouterr().err
    with pytest.raises(UnsupportedError, match="use stage 2"):
        settle_offload(zero, 1, torch.device("cuda", 0))


def test_blind_memory_model_is_reported():
    from autotuner.tuning.profiling.launches import blind_spots

    from fakes import model_info

    infos = [model_info(activation_bytes=0, engines_in_process=2)] * 2
    warnings = blind_spots(infos)
    assert len(warnings) == 2 and "saw no activations" in warnings[0] and "2 engines" in warnings[1]
    assert all("autotuning.model_info" in w for w in warnings)
    assert blind_spots([model_info(activation_bytes=10)] * 2) == []


def test_launcher_names_are_accepted_on_one_node_and_a_missing_hostfile_is_a_note(tmp_path):
    script = write_script(tmp_path, "echo.py", ECHO)
    for name in ("pdsh", "OpenMPI", "slurm"):
        plan = build_plan(LaunchOptions(script=str(script), launcher=name, nproc_per_node=1), "python", {})
        assert plan.nproc_per_node == 1 and plan.num_nodes == 1
    plan = build_plan(LaunchOptions(script=str(script), hostfile=str(tmp_path / "absent")), "python", {})
    assert plan.notes and "not found; training with this node's resources only" in plan.notes[0]
