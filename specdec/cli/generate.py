"""`specdec generate`: stream a completion to stdout and a one-line stats summary to stderr."""
from __future__ import annotations

import argparse
import sys

from specdec.native_record import ACTIVATIONS, ACTIVATIONS_HELP
from specdec.runtime.adaptive_gamma import GammaPolicyName
from specdec.runtime.config import (AUTO_BACKEND, BACKEND_CHOICES, COUPLINGS, DRAFTERS, GAMMA_POLICIES, BackendName,
                                    Coupling, DrafterName)


def add_generate_parser(commands) -> None:
    parser = commands.add_parser("generate", help="generate text from a bundle")
    parser.add_argument("bundle")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the bundle's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 is greedy (default: the bundle's, greedy unless its manifest says otherwise)")
    parser.add_argument("--top-k", type=int, default=None, help="0 turns top-k off (default: the bundle's, off)")
    parser.add_argument("--top-p", type=float, default=None, help="1.0 turns top-p off (default: the bundle's, off)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--gamma", type=int, default=None, help="draft length (default: the bundle's)")
    parser.add_argument("--gamma-policy", choices=GAMMA_POLICIES, default=GammaPolicyName.FIXED,
                        help="fixed γ, adaptive (from running per-position acceptance) or HF's +2/-1 heuristic")
    parser.add_argument("--drafter", choices=DRAFTERS, default=DrafterName.AUTO)
    parser.add_argument("--coupling", choices=COUPLINGS, default=Coupling.LEVIATHAN,
                        help="sampled tokens: leviathan (the paper's rule, default) or gumbel (noise fixed by seed and "
                             "position: the same seed gives the same text whatever the drafter and γ)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default=AUTO_BACKEND,
                        help="auto (default): cuda on a GPU; on the CPU native where the bundle and machine allow it, "
                             "else onnxruntime; native: specdec's own CPU kernels over the bundle's native weights (an "
                             "AVX2 CPU and a C compiler); cuda: specdec's own GPU kernels over the same weights (an "
                             "NVIDIA GPU and the [cuda] extra); onnxruntime: any bundle")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda:N (default: cuda:0 for --backend cuda; with auto, a GPU where CuPy sees one)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default=None, help=ACTIVATIONS_HELP)
    parser.add_argument("--no-verify", action="store_true", help="skip checking the bundle's file hashes")
    from specdec.cli.serve import add_prompt_budget_args

    budget = parser.add_argument_group("the chat prompt's budget (--chat renders the template in a worker process)")
    add_prompt_budget_args(budget, "past it the command fails")
    parser.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from specdec.runtime import load
    from specdec.runtime.config import GenerationConfig
    from specdec.runtime.prompt_worker import PromptBudget

    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, gamma=args.gamma, gamma_policy=args.gamma_policy, drafter=args.drafter, stop=tuple(args.stop),
        chat=args.chat, coupling=args.coupling,
    )
    budget = PromptBudget(workers=1, timeout_s=args.prompt_timeout, memory_mb=args.prompt_worker_memory)
    with load(args.bundle, backend=args.backend, device=args.device, verify=not args.no_verify,
              prompt_budget=budget, activations=args.activations) as generator:
        for piece in generator.stream(args.prompt, config):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(f"[{args.drafter}, {generator.backend}, {generator.activations}] {generator.last_stats.summary()}",
              file=sys.stderr)
        if BackendName(args.backend) is BackendName.AUTO and generator.backend_note:
            print(f"({generator.backend}: {generator.backend_note})", file=sys.stderr)
    return 0
