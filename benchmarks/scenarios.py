"""Every benchmark scenario by name: the command that produces a figure of docs/benchmarks.md, at a size for 2 cores.

`phalanx bench --suite cpu` (phalanx/tools/bench_suite.py) runs them one after the other from the checkout's root.
A scenario is a command line of Python (a script here, or a module of phalanx.tools) with `{json}` where it writes
its figures (phalanx/tools/bench_compare.py `write_figures`), what it needs beyond a CPU (root, network namespaces,
tc, a GPU, torchft: the suite skips it where one is missing), a timeout, and the seconds it took on the 2-core VM
(quiet, 2026-11-29; for the ETA). Pure data, no imports of phalanx: tests/unit/test_benchmark_docs.py reads it
without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

HOSTS = ("root", "netns")  # hosts as network namespaces on a bridge
SHAPED = ("root", "netns", "tc")  # ... with every port shaped


@dataclass(frozen=True)
class Scenario:
    name: str  # area.what, named on docs/benchmarks.md after the figures it produces
    argv: tuple[str, ...]  # after `python`: a script path or `-m module`, then its flags; `{json}`: its figures file
    about: str  # one line: what it measures
    expect_s: float  # wall seconds on the 2-core VM at this size (the progress line's ETA)
    needs: tuple[str, ...] = ()  # phalanx/tools/bench_suite.py NEEDS: root, netns, tc, cuda, torchft
    timeout_s: float = 300.0

    @property
    def area(self) -> str:
        return self.name.split(".", 1)[0]

    def command(self, json_path: str) -> list[str]:
        return [part.replace("{json}", json_path) for part in self.argv]


def _script(path: str, *flags: str) -> tuple[str, ...]:
    return (f"benchmarks/{path}", *flags, "--json", "{json}")


BENCH = ("-m", "phalanx.tools.bench")
S = Scenario
SCENARIOS: tuple[Scenario, ...] = (
    # -- the exchange on one host
    S("exchange.ddp_vs_torch", (*BENCH, "--models", "wide,deep,gpt", "--blocks", "2", "--steps", "6", "--warmup", "2",
                                "--profile", "--out", "{json}"),
      "a step of torch DDP, phalanx DDP (shared memory, and on Gloo) and compute-only; the all-reduce alone; "
      "where phalanx's step goes", 49),
    S("exchange.floor", _script("exchange/exchange_floor.py", "--blocks", "3", "--steps", "6"),
      "compute-only plus the exchange's kernels alone, against phalanx DDP", 22),
    S("exchange.stream", _script("exchange/exchange_choices.py", "stream", "--blocks", "3", "--steps", "6"),
      "streaming stores on and off in the shared-memory exchange", 20),
    S("exchange.hooks", _script("exchange/hook_cost.py", "deep", "--rounds", "4", "--steps", "20"),
      "a Python post-accumulate-grad hook per parameter, without DDP", 12),
    S("exchange.compile", _script("exchange/compile_overlap.py", "gpt", "--variants", "eager", "ddp(compile)", "torch",
                                  "--blocks", "2", "--steps", "3"),
      "phalanx DDP under torch.compile: step time and overlap", 31, timeout_s=300),
    # -- across hosts
    S("hosts.hierarchical", _script("hosts/xhost_bench.py", "--hosts", "2", "--nproc-per-node", "2", "--link",
                                    "300mbit", "--models", "gpt", "--blocks", "2", "--steps", "2"),
      "torch DDP, phalanx flat and hierarchical on 2 namespace hosts x 2 ranks, a shaped link", 40, SHAPED),
    S("hosts.plan", _script("hosts/xhost_plan.py", "--calibration", "benchmarks/results/xhost-n2-100mbit.json"),
      "the cost model's all-reduce time, flat against hierarchical, to 64 hosts", 4),
    # -- DiLoCo across hosts
    S("diloco.bytes_speed", _script("hosts/diloco_bench.py", "--hosts", "2", "--nproc-per-node", "2", "--link",
                                    "300mbit", "--every", "50", "--compress", "int8", "--fragments", "5", "--delay",
                                    "2", "--steps", "3"),
      "DiLoCo H=50 int8 streaming on 2 namespace hosts x 2: bytes on host 0's port per step and samples/s, against "
      "exact DDP, torch DDP and an unshaped link", 66, SHAPED),
    S("diloco.quality", _script("hosts/diloco_quality.py", "--hosts", "2", "--seeds", "0", "--steps", "100",
                                "--every", "50", "--lr", "2e-3", "--outer-lr", "1", "--momentum", "0.5"),
      "examples/gpt's validation loss after the same samples, exact DDP against DiLoCo H=50 int8 (outer lr 1, "
      "momentum 0.5)", 34),
    S("diloco.live_recovery", _script("hosts/diloco_quality.py", "--hosts", "3", "--seeds", "0", "--steps", "100",
                                      "--every", "50", "--kill-host", "1", "--kill-at-step", "75"),
      "examples/gpt's validation loss, DiLoCo H=50 on 3 hosts with one SIGKILLed in mid-period under live recovery, "
      "against the uninterrupted run", 70),
    # -- sharding
    S("sharding.memory", (*BENCH, "--memory", "--worlds", "2", "--rss-worlds", "2", "--rss-variants",
                          "torch-ddp,phalanx-none,phalanx-gradients,phalanx-parameters+meta", "--time-models", "wide",
                          "--steps", "3", "--blocks", "2", "--out", "{json}"),
      "model-state bytes, peak RSS and step time of each shard level", 87),
    S("sharding.allocators", _script("sharding/allocator_ab.py", "--models", "wide", "--rounds", "1", "--steps", "3",
                                     "--blocks", "1"),
      "glibc's malloc, tcmalloc and mimalloc: step time at every shard level", 50),
    # -- host work per step
    S("host.overhead", (*BENCH, "--overhead", "--rounds", "60", "--out", "{json}"),
      "the host time per step each DDP adds to a model of 200 tiny tensors", 22),
    # -- live recovery
    S("live_recovery.kill_rank", _script("live_recovery/live_recovery_timing.py", "--rounds", "2", "--where", "rank"),
      "a rank of 3 SIGKILLed: the kill to the next step", 25),
    S("live_recovery.kill_host", _script("live_recovery/live_recovery_timing.py", "--rounds", "2", "--where", "host"),
      "a namespace host of 3 SIGKILLed: the kill to the next step", 33, HOSTS),
    S("live_recovery.cut_host", _script("live_recovery/live_recovery_timing.py", "--rounds", "1", "--where", "cut"),
      "a namespace host of 3 cut off: the cut to the next step", 19, HOSTS),
    S("live_recovery.healthy_step", _script("live_recovery/live_recovery_overhead.py", "deep", "wide", "gpt",
                                            "--blocks", "2", "--steps", "6", "--transport", "gloo"),
      "what live recovery costs a healthy step: the commit and the watched waits", 22),
    S("live_recovery.shard_copies", _script("live_recovery/live_recovery_overhead.py", "deep", "gpt", "--blocks", "2",
                                            "--steps", "4", "--shard", "gradients", "--transport", "gloo"),
      "the optimizer chunks' copies a sharded healthy step pays for", 16),
    S("live_recovery.join", _script("live_recovery/live_join_timing.py", "--rounds", "1"),
      "a namespace host back: its start to its first step, taken in by the workers in progress", 45, SHAPED),
    S("live_recovery.elastic", _script("live_recovery/elastic_timing.py", "--rounds", "1", "--epochs", "10"),
      "the restart from a checkpoint: a node lost, a node back, goodput", 50, HOSTS),
    S("live_recovery.chaos", _script("live_recovery/live_recovery_chaos.py", "--minutes", "0.5", "--every", "8:12",
                                     "--seed", "1", "--rdzv-timeout", "40"),
      "three namespace hosts under kills, cuts and stops; every step checked", 85, SHAPED, timeout_s=300),
    S("live_recovery.torchft", _script("live_recovery/torchft_compare.py", "--kills", "1"),
      "torchft on the same machine: a replica killed, a healthy step", 60, ("torchft",)),
    # -- live recovery's control plane
    S("control_plane.steady", _script("control_plane/control_plane.py", "--hosts", "2", "4", "--steps", "10"),
      "connections and segments live recovery adds per rank and step, on namespace hosts", 29, HOSTS),
    S("control_plane.loss", _script("control_plane/control_plane.py", "--hosts", "4", "--kill", "--cut"),
      "a namespace host of 4 killed or cut off: named, regrouped, the next step", 27, HOSTS),
    S("control_plane.hosts_of_4", _script("control_plane/control_plane.py", "--hosts", "4", "--per-host", "4",
                                          "--steps", "10"),
      "the same counts on 4 namespace hosts of 4 ranks: a host's ranks commit through its speaker", 20, HOSTS),
    S("control_plane.loss_hosts_of_4", _script("control_plane/control_plane.py", "--hosts", "4", "--per-host", "4",
                                               "--kill"),
      "a namespace host of 4 ranks killed whole: named, regrouped, the next step", 15, HOSTS),
    S("control_plane.units", _script("control_plane/control_plane_units.py", "--hosts", "2", "4", "--rounds", "5"),
      "the control plane's unit costs: a store operation, a probe, a regroup's Gloo groups, full mesh and lazy", 34,
      HOSTS),
    S("control_plane.group_units", _script("control_plane/group_units.py", "--hosts", "2", "4", "--rounds", "3"),
      "a regroup's two Gloo groups as the loss runs' workers make them, beside their launchers", 10, HOSTS),
    S("control_plane.tree_units", _script("control_plane/tree_units.py", "--speakers", "2", "4", "--steps", "300"),
      "the per-step commit's tree: a round among its speakers, a hop", 12),
    S("control_plane.model", _script("control_plane/control_plane_model.py", "--units",
                                     "benchmarks/results/control_plane_units_here5-2026-11-30.json", "--measured",
                                     "benchmarks/results/control_plane_steady_looks-2026-11-29.json",
                                     "benchmarks/results/control_plane_loss_here5-2026-11-30.json", "--design",
                                     "tree"),
      "the control plane's scale model to thousands of ranks, from saved unit costs", 1.4),
    S("control_plane.agreement", _script("control_plane/model_agreement.py", "--sets",
                                         *(f"benchmarks/results/control_plane_units_{name}-2026-11-30.json:"
                                           f"benchmarks/results/control_plane_{runs}_{name}-2026-11-30.json"
                                           for name in ("here", "here2", "here3", "here4", "here5")
                                           for runs in ("loss", "4x4"))),
      "the scale model against five saved sets of loss runs, each with its hour's units, and pooled", 1.4),
    # -- checkpoints and stops
    S("checkpoints.stop_overhead", _script("checkpoints/stop_overhead.py", "deep", "wide", "gpt", "--blocks", "3",
                                           "--steps", "8"),
      "the stop agreement in checkpointer.step(state), per step", 32),
    S("checkpoints.stop_latency", _script("checkpoints/stop_latency.py", "none", "gradients", "--repeats", "1"),
      "SIGTERM to `phalanx run` until it has exited, a 50M-parameter model", 30),
    S("checkpoints.background", _script("checkpoints/async_checkpoint.py", "--ranks", "2", "--blocks", "1",
                                        "--repeats", "2"),
      "a background save: what it blocks, its commit, the step time around it", 54),
    # -- diagnostics
    S("diagnostics.steplog", _script("diagnostics/steplog_overhead.py", "deep", "wide", "gpt", "--blocks", "3",
                                     "--steps", "8"),
      "a StepLog record per step", 29),
    S("diagnostics.record", _script("diagnostics/record_overhead.py", "deep", "wide", "--blocks", "3", "--steps", "8"),
      "the record of collectives", 14),
    S("diagnostics.audit", _script("diagnostics/audit_overhead.py", "deep", "wide", "gpt", "--blocks", "3", "--steps",
                                   "8", "--audits", "3"),
      "the replica audit and the non-finite gradient check", 29),
    # -- on a GPU
    S("gpu.gpt2_small", _script("gpu/gpu_bench.py"),
      "GPT-2 small against torch DDP: step ratios, memory, overlap, shard levels, the host running ahead", 300,
      ("cuda",), timeout_s=900),
    S("gpu.host_profile", _script("gpu/gpu_small_profile.py", "--rounds", "20", "--steps", "20"),
      "where a host-bound GPU step goes", 60, ("cuda",)),
    S("gpu.overhead", (*BENCH, "--overhead", "--device", "cuda", "--rounds", "200", "--out", "{json}"),
      "the host time per step each DDP adds, on a GPU", 60, ("cuda",)),
    S("gpu.audit", _script("diagnostics/audit_overhead.py", "--device", "cuda", "--blocks", "10", "--steps", "20",
                           "--audits", "5"),
      "the replica audit and the non-finite check on a GPU", 60, ("cuda",)),
)
BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}
