"""``python -m dynctx demo``: in-flight batching of a small random Llama through the context.

Builds a ``transformers`` ``LlamaForCausalLM`` with random weights (nothing downloads;
``--model`` picks another family: ``dynctx.models.random_models``), sends a stream of requests
with staggered arrivals and mixed lengths through the reference engine with a KV buffer small
enough that requests pause, resume, get evicted and get chunked, prints a summary, checks every
output against ``transformers``' greedy ``generate`` for that prompt alone, and writes a plot of
active requests, paused requests and KV utilization per step. Exit code 1 when an output does
not match, 2 when a flag is wrong.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import List, Optional

from dynctx._cli_common import (
    ArgumentParser,
    HelpFormatter,
    non_negative_float,
    non_negative_int,
    plain,
    positive_float,
    positive_int,
    program_name,
)
from dynctx.demo_run import DTYPES, FlagError, missing_dependency, run

# dynctx.models.paged_attention.BACKENDS (tests/test_cli.py keeps them equal).
ATTENTION_BACKENDS = ("auto", "torch", "torch_static", "triton", "flashinfer", "flash_attn")
TORCHRUN = "PYTHONSAFEPATH=1 python -P -m torch.distributed.run --nproc-per-node {n} -m dynctx " \
           "demo --tensor-parallel-size {n}"


def build_parser(prog: str = "python -m dynctx demo") -> ArgumentParser:
    from dynctx.models.random_models import RANDOM_MODELS

    parser = ArgumentParser(prog=prog, formatter_class=HelpFormatter,
                            description=plain(__doc__).replace("python -m dynctx demo", prog))
    model = parser.add_argument_group("model (a transformers causal LM, random weights)")
    model.add_argument("--model", default="llama", choices=sorted(RANDOM_MODELS),
                       help="the family: llama and deepseek_v3 run dedicated adapters, the "
                            "others the generic transformers path (windowed families: a "
                            "window of one block)")
    model.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    model.add_argument("--hidden", type=positive_int, default=64,
                       help="hidden size (a multiple of --heads, with an even head size)")
    model.add_argument("--heads", type=positive_int, default=4, help="query heads")
    model.add_argument("--kv-heads", type=positive_int, default=2,
                       help="key/value heads (GQA; they divide --heads)")
    model.add_argument("--intermediate", type=positive_int, default=128,
                       help="MLP intermediate size")
    model.add_argument("--vocab", type=positive_int, default=512,
                       help="vocabulary size (at least 4: prompts draw ids from 3 up)")
    model.add_argument("--max-seq", type=positive_int, default=256,
                       help="max_position_embeddings (more than --max-new-tokens)")
    work = parser.add_argument_group("workload")
    work.add_argument("--requests", type=positive_int, default=24, help="number of requests")
    work.add_argument("--max-new-tokens", type=positive_int, default=32,
                      help="longest generation; each request asks for 1/4 to all of it")
    work.add_argument("--shared-prefix", type=non_negative_int, default=0,
                      help="tokens every prompt starts with (a shared system prompt; prompts "
                           "stay within 3 blocks)")
    work.add_argument("--arrival-every", type=non_negative_float, default=1.5,
                      help="mean engine steps between arrivals (exponential gaps)")
    ctx = parser.add_argument_group("context")
    ctx.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    ctx.add_argument("--buffer-blocks", type=positive_int, default=13,
                     help="KV blocks for requests, the paused budget included (sets "
                          "buffer_size_gb from the model dimensions; the context's padding "
                          "block comes on top)")
    ctx.add_argument("--paused-blocks", type=non_negative_int, default=3,
                     help="paused budget in blocks, part of --buffer-blocks (sets "
                          "paused_buffer_size_gb)")
    ctx.add_argument("--buffer-size-gb", type=positive_float, default=None,
                     help="KV buffer in GiB, padding block included; overrides --buffer-blocks")
    ctx.add_argument("--paused-buffer-size-gb", type=non_negative_float, default=None,
                     help="paused budget in GiB; overrides --paused-blocks")
    ctx.add_argument("--max-tokens", type=positive_int, default=32,
                     help="tokens per step; longer prompts are chunked")
    ctx.add_argument("--max-requests", type=positive_int, default=None,
                     help="request rows, at most --max-tokens (default: the context's, about "
                          "one per block, capped at --max-tokens)")
    ctx.add_argument("--kernel-backend", choices=["auto", "triton", "torch"], default=None,
                     help="kernels: compiled Triton on CUDA and the torch references on a CPU "
                          "(auto), or force one; triton on a CPU needs TRITON_INTERPRET=1 "
                          "(default: $DYNCTX_KERNEL_BACKEND, else auto)")
    ctx.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                     help="paged attention: auto runs our Triton kernels on CUDA and the torch "
                          "version on a CPU; triton needs CUDA or TRITON_INTERPRET=1; "
                          "torch_static is the torch version padded to the step's bounds; "
                          "flashinfer and flash_attn need those packages, CUDA and fp16/bf16")
    ctx.add_argument("--rope", choices=["table", "cos_sin"], default="table",
                     help="rotary embedding through Megatron's angle table "
                          "(apply_rotary_emb_query/key) or a cos/sin cache "
                          "(apply_fused_qk_rotary_emb)")
    ctx.add_argument("--prefix-caching", choices=["off", "ref_zero", "lru"], default="off",
                     help="prefix caching and its eviction policy; the summary then shows the "
                          "cache's hit rate")
    ctx.add_argument("--fused-rope-kv-append", action="store_true",
                     help="rotate K and append K/V to the cache in one launch")
    ctx.add_argument("--kv-cache-dtype", choices=["params", "fp8"], default="params",
                     help="the KV cache's dtype: the model's (--dtype), or fp8 (e4m3 with "
                          "dynamic per-layer scales: twice the blocks of bf16 per GiB)")
    ctx.add_argument("--speculative", choices=["off", "ngram", "draft"], default="off",
                     help="speculative decoding: drafts from n-gram prompt lookup or from a "
                          "draft model (a truncated copy of the model), verified exactly")
    ctx.add_argument("--speculative-tokens", type=positive_int, default=3,
                     help="draft tokens a decode request forwards per step (k)")
    run_group = parser.add_argument_group("run")
    run_group.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                           help="model and KV cache dtype; fp16/bf16 accept divergence at "
                                "near-ties")
    run_group.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    run_group.add_argument("--seed", type=non_negative_int, default=0,
                           help="seed of the weights and the workload")
    run_group.add_argument("--threads", type=non_negative_int, default=1,
                           help="torch CPU threads (1 is fastest for a small model; 0 keeps "
                                "torch's)")
    run_group.add_argument("--async-scheduling", action="store_true",
                           help="read each step's sampled tokens one step late, after the next "
                                "step's forward is launched (the host's bookkeeping overlaps "
                                "the device's forward on CUDA); outputs are unchanged; fp32 "
                                "only (the half-precision check records logits)")
    run_group.add_argument("--plot", default="demo.png", help="PNG path ('' skips the plot)")
    run_group.add_argument("--no-progress", action="store_true",
                           help="no progress bars (they need tqdm, go to stderr, and are off "
                                "anyway when stderr is not a terminal)")
    run_group.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                           help="tensor-parallel ranks: run under torchrun with as many "
                                f"processes ({TORCHRUN.format(n='N')}; gloo on a CPU, NCCL on "
                                "CUDA); rank 0 prints, plots and checks, every rank must "
                                "return the same outputs")
    return parser


# --arrival-every x --requests: the mean last arrival step, kept far below int64's range (an
# exponential gap rarely exceeds 40 means).
MAX_ARRIVAL_SPAN = 1e12


def check_args(args) -> Optional[str]:
    """The first problem of the flags together, as one line naming them; None when there is
    none. The flags' own types and ranges are argparse's; this checks how they combine, the
    device and the backends, before anything is built (the KV buffer against the longest
    request is checked once the model says how large a block is: ``demo_run.buffer_problem``)."""
    problem = _check_model(args) or _check_requests(args) or _check_run(args)
    if problem:
        return problem
    return _check_device_and_backends(args)


def _check_model(args) -> Optional[str]:
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not a multiple of --heads {args.heads}"
    if (args.hidden // args.heads) % 2:
        return (f"--hidden {args.hidden} / --heads {args.heads} = {args.hidden // args.heads} "
                "is the head size, which must be even (rotary embeddings rotate pairs)")
    mla = args.model == "deepseek_v3"  # its KV is one latent row: --kv-heads does not apply
    if not mla and args.heads % args.kv_heads:
        return f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}"
    if args.vocab < 4:
        return f"--vocab {args.vocab} is below 4 (prompts draw token ids from 3 up)"
    if args.max_seq <= args.max_new_tokens:
        return (f"--max-seq {args.max_seq} leaves no room for a prompt before "
                f"--max-new-tokens {args.max_new_tokens}: raise --max-seq above it")
    tp = args.tensor_parallel_size
    if tp > 1:
        if args.heads % tp or args.intermediate % tp:
            name, value = (("--heads", args.heads) if args.heads % tp
                           else ("--intermediate", args.intermediate))
            return f"{name} {value} is not divisible by --tensor-parallel-size {tp}"
        if not mla and ((args.kv_heads % tp) if args.kv_heads >= tp else (tp % args.kv_heads)):
            return (f"--kv-heads {args.kv_heads} and --tensor-parallel-size {tp}: one must "
                    "divide the other")
    return None


def _check_requests(args) -> Optional[str]:
    if args.max_requests is not None:
        if args.max_requests > args.max_tokens:
            return (f"--max-requests {args.max_requests} exceeds --max-tokens {args.max_tokens} "
                    "(every request needs a token slot at decode)")
        if args.max_requests % args.tensor_parallel_size:
            return (f"--max-requests {args.max_requests} is not divisible by "
                    f"--tensor-parallel-size {args.tensor_parallel_size}")
    return None


def _check_run(args) -> Optional[str]:
    from dynctx.demo_speculative import check_speculative

    problem = check_speculative(args)
    if problem:
        return problem
    if args.async_scheduling and args.dtype != "fp32":
        return (f"--async-scheduling with --dtype {args.dtype}: the half-precision check records "
                "every step's logits (record_logits), which async scheduling refuses; use "
                "--dtype fp32")
    cpus = os.cpu_count() or 1
    if args.threads > cpus:  # 100000 crashed torch.set_num_threads (a segmentation fault)
        return f"--threads {args.threads} is more than the {cpus} CPUs here (os.cpu_count())"
    if args.arrival_every * args.requests > MAX_ARRIVAL_SPAN:
        return (f"--arrival-every {args.arrival_every:g} with --requests {args.requests} "
                f"spreads arrivals over more than {MAX_ARRIVAL_SPAN:.0e} steps (their product "
                "is at most that: the arrival steps are int64)")
    if args.plot:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            return f"--plot {args.plot}: the folder {folder} does not exist"
    tp = args.tensor_parallel_size
    if tp > 1 and "WORLD_SIZE" not in os.environ and not _distributed_initialized():
        return (f"--tensor-parallel-size={tp} needs one process per rank: launch with "
                f"{TORCHRUN.format(n=tp)}")
    return None


def _distributed_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _check_device_and_backends(args) -> Optional[str]:
    import torch

    from dynctx.kernels import backend
    from dynctx.models.paged_attention import resolve_attention_backend

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as exc:
        return f"--device {args.device} is not a torch device ({exc})"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {args.device}: no CUDA GPU is visible (torch.cuda.is_available())"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return (f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) "
                    "are visible")
    flag = ("--kernel-backend" if args.kernel_backend is not None
            else f"${backend.BACKEND_ENV}")
    try:
        kernels = backend.check_backend_name(args.kernel_backend)
        backend.resolve_backend(kernels, device)
    except ValueError as exc:
        return str(exc)
    except RuntimeError:
        if not backend.HAS_TRITON:
            return f"{flag} triton: triton is not installed (use torch)"
        return (f"{flag} triton on device {device}: the Triton kernels run on CUDA, or on a "
                "CPU under TRITON_INTERPRET=1 set before Python starts (or use torch)")
    dtype = getattr(torch, DTYPES[args.dtype])
    try:
        resolve_attention_backend(args.attention_backend, device, args.block_size, dtype)
    except RuntimeError as exc:
        return f"--attention-backend {args.attention_backend}: {exc}"
    return None


def _start_distributed(args) -> tuple:
    """``(rank, world, created)`` of the tensor-parallel run (``(0, 1, False)`` without one).
    Initialises torch.distributed from torchrun's environment when nobody has yet."""
    import torch
    import torch.distributed as dist

    tp = args.tensor_parallel_size
    if tp == 1:
        return 0, 1, False
    created = False
    if not dist.is_initialized():
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        created = True
    world = dist.get_world_size()
    if world != tp:
        raise SystemExit(f"--tensor-parallel-size={tp} but torch.distributed has {world} "
                         f"ranks (--nproc-per-node {tp})")
    if args.device == "cuda":
        args.device = f"cuda:{torch.cuda.current_device()}"
    return dist.get_rank(), world, created


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    parser = build_parser(prog or f"{program_name()} demo")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401 (the demo's extra; the flag checks import the models)
    except ImportError as error:
        return missing_dependency(error)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    rank, world, created = _start_distributed(args)
    try:
        code = run(args, rank, world)
    except FlagError as error:
        parser.error(str(error))
    if not created:
        return code
    import torch.distributed as dist

    # Free the engine now (its context and model hold the process group, in reference cycles):
    # a group left for the interpreter's exit to destroy sometimes aborted a rank there
    # ("terminate called without an active exception"). Then the ranks leave together.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
