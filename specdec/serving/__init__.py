"""specdec serving (docs/serving.md): an OpenAI-compatible HTTP API over one engine loop with continuous batching and
load-adaptive speculation, and its Ray Serve scale-out. Depends on the runtime only; the runtime never imports it.

- `options.ServeOptions`: the server's options, checked once.
- `engine.Engine`: owns the backends; requests join and leave the running batch at round boundaries.
- `goodput.GoodputGamma`: γ per round (0 included) from measured costs and acceptance.
- `app.build_app`: the FastAPI app (`specdec serve`); `ray_app.build_app`: the same app on Ray Serve replicas.
"""
