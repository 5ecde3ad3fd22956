"""Training a draft head from the target, on a CPU (`specdec calibrate head BUNDLE` without --from; docs/heads.md).

PyTorch at training time only: the runtime never imports this package.
- `prompts`, `words`: the training prompts (templates, word lists, the standard library's docstrings);
- `generate`, `shards`: the target's answers with its hidden states and soft labels, in shards on disk;
- `init`: the draft vocabulary and the first weights, from the target's own;
- `torch_head`: the head in PyTorch (the function specdec.head.model runs) and the training-time test;
- `loss`, `train`: the objective and the loop (checkpoints, resume, budgets);
- `config`, `pipeline`, `stages`: the command's options and its run.
"""
