"""python -m bench {speed,quality}: the benchmarks, one command each, results as files.

  python -m bench speed   [--model DIR] [--sentences FILE|N] [--forced-tokens N] [--threads 2] [--num-beams N|model]
                          [--peers] [--external NAME=DIR ...] [--quick] [--out DIR]
  python -m bench quality [--model DIR] [--input FILE|DIR] [--sentences N] [--engine local|ray [--address A] [--actors N]]
                          [--external NAME=DIR ...] [--out DIR]
  python -m bench table RESULTS_DIR       # a speed run's compact table with ratios, for the README
  python -m bench load    (--url URL [--pid PID] | --launch [-- APP_ARGS]) [--users 16] [--requests 400] [--out DIR]
                          [--target compare|translate|http|serve] [--duration S] [--baseline-export DIR]
  python -m bench load-curve (--url URL [--pid PID] | --launch [-- APP_ARGS]) --backends A,B [--users 1,2,...,64]
                          [--duration 30] [--out DIR]
  python -m bench locate  EXPORT_DIR --backend NAME --text "..." [--step N|max] [--json OUT] [--max-new-tokens N]

Each writes results.json and report.md (speed: also PNG plots) into --out, by default
bench-results/<command>-<model>-<UTC time>/. See bench/README.md for what is measured and left out.
`--external NAME=DIR` (speed, quality; repeatable): an Optimum-layout export of the same model as one
more backend NAME, beside the built-in ones (backends/ort_external.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from . import peers as peers_mod
from .data import DEFAULT_TSV, RESULTS, resolve_model, sentences_arg
from .decoding import SWEEP_IS_GREEDY, resolve_decoding
from .load import TARGETS as LOAD_TARGETS
from .load_curve import DEFAULT_USERS


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(value: str) -> tuple[int, ...]:
    return tuple(int(v) for v in _csv(value))


def _num_beams(value: str) -> int | str:
    """--num-beams: 1 (greedy) to MAX_BEAMS, or 'model' (the export's generation config)."""
    from backends import MAX_BEAMS

    if value.strip().lower() == "model":
        return "model"
    try:
        beams = int(value)
    except ValueError:
        beams = None
    if beams is None or not 1 <= beams <= MAX_BEAMS:
        raise argparse.ArgumentTypeError(f"expected an integer in 1..{MAX_BEAMS} (1: greedy search) or 'model' "
                                         f"(the export's generation config), got {value!r}")
    return beams


def _default_out(command: str, export_dir: Path) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return RESULTS / f"{command}-{export_dir.name}-{stamp}"


def _external(args) -> dict[str, str]:
    from backends.ort_external import parse_external

    return parse_external(args.external)  # ValueError naming the malformed value: before any work


def speed(args) -> int:
    from service.speedrun import SpeedOptions

    from . import speed as speed_mod

    external = _external(args)

    def check(beams: int) -> None:  # before any work: the export, when --model needs one, takes minutes
        if beams > 1 and args.sweep:
            raise ValueError(f"--sweep {','.join(map(str, args.sweep))}: {SWEEP_IS_GREEDY.format(n=beams)}; "
                             "drop --sweep (with beam search it is skipped) or --num-beams")
        if beams == 1 and (args.length_penalty is not None or args.early_stopping is not None):
            raise ValueError("--length-penalty and --early-stopping apply to beam search only: add --num-beams N (N > 1)"
                             + (" (the export's generation config has num_beams 1)" if args.num_beams == "model" else ""))

    if args.paired_rounds and not args.peers:
        raise ValueError("--paired-rounds pairs our runtimes with peers (CTranslate2, generate()): add --peers")
    if args.num_beams != "model":
        check(args.num_beams)
    pairs = sentences_arg(args.sentences)
    export_dir = resolve_model(args.model, threads=args.threads)
    from backends import load_manifest

    decoding = resolve_decoding(load_manifest(export_dir), args.num_beams, args.length_penalty,
                                          args.early_stopping)
    check(decoding["num_beams"])
    fields = dict(threads=args.threads, forced_tokens=args.forced_tokens, max_new_tokens=args.max_new_tokens,
                  warmup=args.warmup, timeout_s=args.timeout, sweep_peers=args.sweep_peers, floor=not args.no_floor,
                  rounds=args.rounds, paired_rounds=args.paired_rounds, ct2_probe_rounds=args.ct2_probe_rounds)
    if args.quick:
        fields.update(speed_mod.QUICK)
    for name in ("latency_sentences", "throughput_sentences", "sweep_sentences"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.batch_sizes:
        fields["batch_sizes"] = args.batch_sizes
    if args.sweep is not None:
        fields["sweep_lengths"] = args.sweep
    options = SpeedOptions(**fields)
    peers = []
    if args.peers:
        peers = args.peer_list or list(peers_mod.PEER_NAMES)
    out = args.out or _default_out("speed", export_dir)
    print(f"benchmarking {export_dir} on {len(pairs)} sentences, {decoding['label']} -> {out}", flush=True)
    results = speed_mod.run(export_dir, pairs, options, out, backend_names=args.backends, peer_names=peers,
                            peer_python=args.peer_python, log=lambda m: print(m, flush=True),
                            num_beams=args.num_beams,
                            length_penalty=args.length_penalty, early_stopping=args.early_stopping,
                            external=external)
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}" + "".join(f", {out / p}" for p in results.get("plots", [])))
    return 1 if results["failed"] or any("error" in p for p in results.get("paired", {}).values()) else 0


def _decode_option(value: str) -> tuple[str, object]:
    """--decode KEY=VALUE: a keyword argument for Backend.translate; VALUE read as JSON (4, 1.0, true) or text."""
    import json

    key, sep, raw = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. num_beams=4), got {value!r}")
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def int8_curve(args) -> int:
    from corpus import read_pairs

    from . import int8_curve as curve

    export_dir = resolve_model(args.model, threads=args.threads or 1)
    out = args.out or _default_out("int8-curve", export_dir)
    pairs = list(read_pairs(args.input, require_zh=True))[: args.sentences]
    results = curve.run(export_dir, pairs, out, args.int8_curve, threads=args.threads or 1,
                        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                        speed_sentences=args.int8_speed_sentences, rounds=args.int8_speed_rounds,
                        rescore=args.int8_rescore, auto=args.int8_auto,
                        log=lambda m, **_: print(m, flush=True))
    print(curve.table(results))
    print(f"wrote {out / 'int8_curve.json'}, {out / 'int8_curve.md'}")
    return 0


def quality(args) -> int:
    if args.int8_curve is not None:
        return int8_curve(args)
    from . import quality as quality_mod
    from .engine import EngineOptions, EngineUnavailable
    from .report import write_quality

    external = _external(args)
    options = EngineOptions(engine=args.engine, threads=args.threads, batch_size=args.batch_size,
                            shard_size=args.shard_size, actors=args.actors, address=args.address,
                            model_transfer=args.model_transfer, node_cache=args.node_cache)
    export_dir = resolve_model(args.model, threads=options.threads_per_worker)
    out = args.out or _default_out("quality", export_dir)
    try:
        results = quality_mod.run(export_dir, args.input, out, names=args.backends, options=options,
                                  limit=args.sentences, max_new_tokens=args.max_new_tokens,
                                  decode=dict(args.decode or []), log=lambda m: print(m, flush=True),
                                  external=external)
    except EngineUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_quality(results, out)
    for name, b in results["backends"].items():
        a, q = b["agreement"], b["vs_references"] or {}
        print(f"{name}: identical tokens {a['identical']}/{a['n']}, BLEU {q.get('bleu', '–')}, chrF {q.get('chrf', '–')}"
              f", {b['seconds']:.1f} backend-s")
    e = results["engine"]
    if e.get("sentences_per_s"):
        print(f"{e['name']}: {e['sentences_translated']:,} sentences in {e['wall_s']:.1f} s, "
              f"{e['sentences_per_s']:.2f} sentences/s (every backend)")
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'shards'}/*.parquet")
    return 0


def table(args) -> int:
    import json

    from .report import readme_table

    path = args.results / "results.json" if args.results.is_dir() else args.results
    print(readme_table(json.loads(path.read_text(encoding="utf-8"))))
    return 0


def load(args) -> int:
    import os

    from . import load as load_mod
    from .load_report import summary_table

    app_args = args.app_args[1:] if args.app_args[:1] == ["--"] else args.app_args
    if app_args and not args.launch:
        raise ValueError(f"arguments for app.py ({' '.join(app_args)}) need --launch")
    options = load_mod.LoadOptions(
        url=args.url, launch_args=tuple(app_args) if args.launch else None, pid=args.pid, users=args.users,
        requests=args.requests, timeout_s=args.timeout, deadline_s=args.deadline, busy_backoff_s=args.busy_backoff,
        think_s=args.think, warmup=args.warmup, rss_every=args.rss_every, repeat=args.repeat, tsv=args.tsv,
        seed=args.seed, start_timeout_s=args.start_timeout, target=args.target, duration_s=args.duration,
        baseline_export=args.baseline_export, threads=args.baseline_threads, baseline_batches=args.baseline_batches,
        baseline_rounds=args.baseline_rounds, backend=args.backend, rate=args.rate, arrivals=args.arrivals)
    results = load_mod.run(options, args.out, log=lambda m: print(m, flush=True))
    print(summary_table(results))
    print(f"wrote {args.out / 'results.json'}, {args.out / 'report.md'}", flush=True)
    c = results["counts"]
    if c["unfinished_users"]:
        # gradio_client's worker threads are not daemons and the interpreter joins them at exit;
        # a request stuck past every limit would hang that join, so leave without it.
        print(f"error: {len(c['unfinished_users'])} users still waiting past the deadline", file=sys.stderr, flush=True)
        os._exit(1)
    return 1 if c["error"] or c["not_sent"] else 0


def load_curve(args) -> int:
    from . import load as load_mod
    from . import load_curve as curve_mod

    app_args = args.app_args[1:] if args.app_args[:1] == ["--"] else args.app_args
    if app_args and not args.launch:
        raise ValueError(f"arguments for app.py ({' '.join(app_args)}) need --launch")
    base = load_mod.LoadOptions(
        url=args.url, launch_args=tuple(app_args) if args.launch else None, pid=args.pid, target="translate",
        timeout_s=args.timeout, warmup=args.warmup, tsv=args.tsv, seed=args.seed, start_timeout_s=args.start_timeout,
        requests=100_000, deadline_s=3600.0)
    options = curve_mod.CurveOptions(backends=tuple(args.backends), users=tuple(args.users), duration_s=args.duration,
                                     base=base)
    curve = curve_mod.run(options, args.out, log=lambda m: print(m, flush=True))
    print(curve_mod.markdown(curve))
    print(f"wrote {args.out / 'curve.json'}, {args.out / 'curve.md'}", flush=True)
    return 1 if any(p["errors"] for p in curve["points"]) else 0


def locate(args) -> int:
    from . import locate as locate_mod

    step = None if args.step is None else locate_mod.step_arg(args.step)
    return locate_mod.run(args.export_dir, args.backend, args.text, step, args.json, args.threads, args.max_new_tokens)


def fp16_weights(args) -> int:
    from .fp16_weights import round_weights

    counts = round_weights(args.export_dir, args.out, args.part)
    for name, n in counts.items():
        print(f"{name}: {n:,} weight values rounded to fp16 ({args.part})")
    print(f"wrote {args.out}; compare: python -m bench quality --model {args.out} --backends pytorch,ort_fp32_kv_cache")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("speed", help="load time, latency, throughput, memory, size, length sweep")
    sp.add_argument("--model", help="Marian model folder or export folder (default: the embedded model)")
    sp.add_argument("--sentences", help="a count drawn from dev.tsv (default 200, 10-40 words, seed 0), or a "
                    ".tsv with an `en` column, or a text file with one sentence per line")
    sp.add_argument("--forced-tokens", type=int, help="every runtime generates exactly N tokens (random-weight models)")
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--backends", type=_csv, help="comma-separated subset of our backends (default: all)")
    sp.add_argument("--peers", action="store_true", help="also time the peer runtimes (needs `make bench-venv`)")
    sp.add_argument("--peer-list", type=_csv, help=f"subset of peers (default: {','.join(peers_mod.PEER_NAMES)})")
    sp.add_argument("--peer-python", type=Path, default=peers_mod.DEFAULT_PEER_PYTHON)
    sp.add_argument("--quick", action="store_true", help="batch-1 latency over 40 sentences, throughput over 64, "
                    "sweep over 3: the opus-sized run with peers in about 15 minutes")
    sp.add_argument("--latency-sentences", type=int)
    sp.add_argument("--throughput-sentences", type=int)
    sp.add_argument("--sweep-sentences", type=int)
    sp.add_argument("--batch-sizes", type=_ints, help="default 8,32")
    sp.add_argument("--sweep", type=lambda v: _ints(v) if v else (), help="forced lengths (default 8,16,32,64,128; '' = none)")
    sp.add_argument("--sweep-peers", action="store_true", help="run the length sweep for the peers too")
    sp.add_argument("--num-beams", type=_num_beams, default=1,
                    help="every runtime, ours and the peers: 1 = greedy search (the default), 2..16 = beam search "
                    "with that many beams, 'model' = the export's generation config. With beam search the length "
                    "sweep (a greedy measurement) is not run")
    sp.add_argument("--length-penalty", type=float, help="beam search only (default: the export's generation config)")
    sp.add_argument("--early-stopping", type=peers_mod.early_stopping_arg,
                    help="beam search only: true, false or never (default: the export's generation config; "
                    "CTranslate2 has no such option)")
    sp.add_argument("--max-new-tokens", type=int, default=256, help="cap when lengths are not forced")
    sp.add_argument("--warmup", type=int, default=3)
    sp.add_argument("--timeout", type=int, default=3600, help="seconds per runtime")
    sp.add_argument("--no-floor", action="store_true", help="skip the memory-bandwidth floor (1 GB, a few seconds)")
    sp.add_argument("--rounds", type=int, default=1, help="run every runtime N times, round-robin, and report the "
                    "medians: ratios that survive this machine's drift")
    sp.add_argument("--paired-rounds", type=int, default=0, metavar="N",
                    help="then time each target between one of our runtimes and a peer as N back-to-back pairs of "
                         "processes, first alternating; the median pair decides the target (default 0: round-robin only)")
    sp.add_argument("--ct2-probe-rounds", type=int, default=2, metavar="N",
                    help="time each CTranslate2 setting (MKL or oneDNN, 1 thread or all) N times on a short sample first "
                         "and run it with the fastest (default 2; 0: its own choice with --threads threads)")
    sp.add_argument("--external", action="append", default=[], metavar="NAME=DIR",
                    help="also time an Optimum-layout ONNX export of the same model as backend NAME, in its own process like ours (repeatable; DIR may name a variant's encoder file, e.g. DIR/encoder_model_quantized.onnx)")
    sp.add_argument("--out", type=Path)
    sp.set_defaults(func=speed)

    qp = sub.add_parser("quality", help="token agreement with PyTorch, BLEU and chrF per backend, on one machine "
                        "or a Ray cluster")
    qp.add_argument("--model", help="Marian model folder or export folder (default: the embedded model)")
    qp.add_argument("--input", "--tsv", dest="input", type=Path, default=DEFAULT_TSV,
                    help="corpus with `en` and `zh`: .tsv/.tsv.gz, .jsonl/.jsonl.gz, .parquet, or a folder of them")
    qp.add_argument("--sentences", type=int, help="only the first N rows")
    qp.add_argument("--backends", type=_csv)
    qp.add_argument("--threads", type=int, help="per backend (default: 2 with the local engine, 1 per Ray actor)")
    qp.add_argument("--batch-size", type=int, default=16)
    qp.add_argument("--max-new-tokens", type=int, default=256)
    qp.add_argument("--decode", type=_decode_option, action="append", metavar="KEY=VALUE",
                    help="a further Backend.translate option, e.g. num_beams=4 (repeatable)")
    qp.add_argument("--engine", choices=("local", "ray"), default="local",
                    help="local: this process; ray: Ray Data and an actor pool (a local cluster, or --address)")
    qp.add_argument("--address", help="ray: join this cluster ('auto', or 'ray://host:port'); default: start one here")
    qp.add_argument("--actors", type=int, help="ray: actors, each loading the backends once (default: one per "
                    "CPU slot, the cluster's CPUs // --threads)")
    qp.add_argument("--shard-size", type=int, default=128, help="sentences per shard: the unit of work, retry and resume")
    qp.add_argument("--model-transfer", choices=("auto", "shared", "ship"), default="auto",
                    help="ray: 'shared' when the export path is the same on every node, 'ship' to send it through "
                    "the object store (once per node, checksums checked there); auto: ship when there are other nodes")
    qp.add_argument("--node-cache", help="ray: where shipped exports go on each node (default: its temp folder)")
    qp.add_argument("--external", action="append", default=[], metavar="NAME=DIR",
                    help="also run an Optimum-layout ONNX export of the same model as backend NAME (repeatable; DIR may name a variant's encoder file, e.g. DIR/encoder_model_quantized.onnx)")
    qp.add_argument("--int8-curve", type=_ints, metavar="N,N,...",
                    help="instead: int8 with the N most sensitive nodes kept in fp32, for each N (0 added): identical "
                    "to PyTorch greedy and at the model's beams, BLEU, ms/token at batch 1 (1 thread unless --threads)")
    qp.add_argument("--int8-speed-sentences", type=int, default=30, help="--int8-curve: sentences timed at batch 1")
    qp.add_argument("--int8-speed-rounds", type=int, default=3, help="--int8-curve: round-robin timing rounds")
    qp.add_argument("--int8-auto", action="store_true", help="--int8-curve: also the choice --int8-keep auto makes")
    qp.add_argument("--int8-rescore", type=int, default=0, metavar="K", help="--int8-curve: also each count with "
                    "the output layer's K best logits re-scored in fp32 instead of the layer kept (0: not)")
    qp.add_argument("--out", type=Path, help="results folder; a rerun with the same --out resumes")
    qp.set_defaults(func=quality)

    tp = sub.add_parser("table", help="print a speed run's compact table (for the README)")
    tp.add_argument("results", type=Path, help="a speed run's folder or its results.json")
    tp.set_defaults(func=table)

    lp = sub.add_parser("load", help="concurrent users against the app's `compare` or `translate` API: latency, "
                        "busy, errors, RSS")
    target = lp.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running app, e.g. http://127.0.0.1:7860/")
    target.add_argument("--launch", action="store_true", help="start app.py (arguments after -- go to it: "
                        "`--launch -- --queue-size 4`), drive it, stop it")
    lp.add_argument("--pid", type=int, help="with --url: the app's process id, for its memory (children included)")
    lp.add_argument("--users", type=int, default=16, help="concurrent clients, one request in flight each")
    lp.add_argument("--requests", type=int, default=400, help="requests in all, busy rejections included (with "
                    "--duration: at most)")
    lp.add_argument("--target", choices=LOAD_TARGETS, default="compare",
                    help="the endpoint: compare (every backend), translate (one sentence per request, batched, "
                    "through Gradio's queue), http (the same batched translate as the app's POST /translate) or "
                    "serve (the translate API on Ray Serve: --url http://HOST:PORT/translate)")
    lp.add_argument("--duration", type=float, help="send requests for this many seconds after the warm-up")
    lp.add_argument("--rate", type=float, help="open loop: requests arrive at this many per second whatever the "
                    "answers, on --users connections (default: closed loop, each user waits for its answer)")
    lp.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson",
                    help="open loop: exponential (poisson) or equal gaps between arrivals")
    lp.add_argument("--backend", help="translate, serve: the backend every request names (default: the server's "
                    "default)")
    lp.add_argument("--baseline-export", type=Path, help="translate: afterwards, time the served backend offline "
                    "at each --baseline-batches size from this export (the one the app serves) on the same sentences")
    lp.add_argument("--baseline-batches", type=lambda v: tuple(int(x) for x in v.split(",")), default=(32, 16),
                    help="the baseline's batch sizes, comma-separated (default: 32,16)")
    lp.add_argument("--baseline-rounds", type=int, default=3, help="the baseline's alternating rounds; the median "
                    "counts (default: 3)")
    lp.add_argument("--baseline-threads", type=int, help="the baseline's threads (default: physical cores, as the "
                    "app's --threads)")
    lp.add_argument("--timeout", type=float, default=120.0, help="seconds per request before it is cancelled")
    lp.add_argument("--deadline", type=float, default=1800.0, help="seconds after which no request is sent")
    lp.add_argument("--busy-backoff", type=float, default=1.0, help="seconds a user waits after a busy answer")
    lp.add_argument("--think", type=float, default=0.0, help="seconds a user waits after each answer")
    lp.add_argument("--warmup", type=int, default=2, help="requests one at a time first, not counted")
    lp.add_argument("--rss-every", type=int, default=100, help="sample the app's memory every N finished requests")
    lp.add_argument("--repeat", type=int, default=1, help="the endpoint's runs per backend")
    lp.add_argument("--tsv", type=Path, default=DEFAULT_TSV, help="sentences: 10-40-word `en` rows, drawn with --seed")
    lp.add_argument("--seed", type=int, default=0)
    lp.add_argument("--start-timeout", type=float, default=900.0, help="with --launch: seconds for the app to serve")
    lp.add_argument("--out", type=Path, default=RESULTS / "load")
    lp.add_argument("app_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    lp.set_defaults(func=load)

    cp = sub.add_parser("load-curve", help="the translate endpoint under 1..64 closed-loop users, per backend: "
                        "sentences/s and P50/P95/P99 per point (the Benchmark tab's load plots)")
    target = cp.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running app, e.g. http://127.0.0.1:7860/")
    target.add_argument("--launch", action="store_true", help="start app.py (arguments after -- go to it), sweep, stop it")
    cp.add_argument("--pid", type=int, help="with --url: the app's process id, for its memory")
    cp.add_argument("--backends", type=_csv, required=True, help="comma-separated: each request names one")
    cp.add_argument("--users", type=_ints, default=list(DEFAULT_USERS),
                    help=f"rising user counts (default {','.join(map(str, DEFAULT_USERS))})")
    cp.add_argument("--duration", type=float, default=30.0, help="seconds per point after its warm-up")
    cp.add_argument("--timeout", type=float, default=120.0, help="seconds per request before it is cancelled")
    cp.add_argument("--warmup", type=int, default=2, help="requests one at a time before each point, not counted")
    cp.add_argument("--tsv", type=Path, default=DEFAULT_TSV)
    cp.add_argument("--seed", type=int, default=0)
    cp.add_argument("--start-timeout", type=float, default=900.0)
    cp.add_argument("--out", type=Path, default=RESULTS / "load-curve")
    cp.add_argument("app_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    cp.set_defaults(func=load_curve)

    fp = sub.add_parser("fp16-weights", help="a copy of an export whose fp32 graphs carry fp16-rounded weights, "
                        "to tell the weights' rounding from fp16 arithmetic (then `quality` on the copy)")
    fp.add_argument("export_dir", type=Path)
    fp.add_argument("--out", type=Path, required=True, help="a new folder for the copy")
    fp.add_argument("--part", default="all", help="which weights: all, encoder, decoder, large (matrices of at "
                    "least 65,536 values), small (the rest), all-but-output (default: all)")
    fp.set_defaults(func=fp16_weights)

    xp = sub.add_parser("locate", help="which module of a backend's graph drifted from PyTorch at one step")
    xp.add_argument("export_dir", type=Path)
    xp.add_argument("--backend", required=True, help="ort_fp32_single_step, ort_fp32_kv_cache, ort_fp16 or ort_int8")
    xp.add_argument("--text", required=True, help="one sentence")
    xp.add_argument("--step", help="0-based step, or 'max' (largest teacher-forced |Δlogit|); default: the first "
                    "diverging step, else 'max'")
    xp.add_argument("--json", type=Path, help="also write the report here")
    xp.add_argument("--threads", type=int, default=None)
    xp.add_argument("--max-new-tokens", type=int, default=None, help="cap on the translations that pick the step")
    xp.set_defaults(func=locate)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
