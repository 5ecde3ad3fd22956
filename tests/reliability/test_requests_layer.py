"""The request layer: a seeded request reproduces `Generator.generate` on
every path (interleaved streams, threads, suspended and resumed, served alone and batched) for every drafter, on
each CPU backend that opens here, with its output still the target's distribution at every draft position; every
option is checked once, in the request layer, and the server answers refusals without echoing what it was sent."""
from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import zip_longest
from pathlib import Path

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig
from specdec.errors import ConfigError, SpecDecError
from specdec.native_record import Activations
from tests.runtime.test_distribution import NEW_TOKENS, PROMPT, SAMPLES, TOP_K, exact_joint, p_value, window

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "a + b\n", "Summarize the following text"]
DRAFTERS = ["model", "prompt_lookup", "auto", "none"]
BACKENDS = ["onnxruntime", "native"]
SERVING = Path(specdec.__file__).parent / "serving"


def sampled(drafter: str, seed: int, **extra) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=24, temperature=0.9, top_k=20, seed=seed, drafter=drafter, **extra)


@pytest.fixture(scope="module")
def q41_bundle(tmp_path_factory):
    """A tiny LLaMA on the GGUF grids with an int4-q41 draft: the kind of bundle the native backend runs."""
    from specdec.calibration.bundle_io import quantized_bundle
    from specdec.calibration.data import DataConfig
    from specdec.calibration.quantize import QuantizeConfig
    from specdec.export.bundle import export_bundle
    from specdec.export.config import ExportConfig
    from specdec.export.tiny import save_tiny_on_grids

    root = tmp_path_factory.mktemp("native")
    model = save_tiny_on_grids(root / "model", family="llama", seed=0, init_range=0.5, hidden=64)
    grid = export_bundle(ExportConfig(out=root / "grid", target=str(model), max_seq_len=256, gamma=3, gamma_max=6,
                                      max_batch=4, max_prefill_chunk=16, progress=False, lowering="gqa",
                                      draft_from_target="int4", activations=Activations.FP32))
    config = QuantizeConfig(method="int4-q41", data=DataConfig(seq_len=16, num_samples=4), head_tokens=48)
    return quantized_bundle(grid, root / "q41", config)


@pytest.fixture(scope="module", params=BACKENDS)
def backend_bundle(request, gqa_int4_bundle):
    """(backend, bundle): onnxruntime on the gqa INT4 bundle; native on a q41 bundle, where it opens here."""
    if request.param == "onnxruntime":
        return request.param, gqa_int4_bundle
    bundle = request.getfixturevalue("q41_bundle")
    try:
        specdec.load(bundle, backend="native").close()
    except SpecDecError as exc:
        pytest.skip(f"the native backend does not open here: {exc.message}")
    return request.param, bundle


@pytest.fixture(scope="module")
def gen(backend_bundle):
    backend, bundle = backend_bundle
    with specdec.load(bundle, backend=backend) as generator:
        yield generator


# --- a seeded request is its own on every path ---------------------------------------------------------------------
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_interleaved_seeded_streams_reproduce_generate(gen, drafter):
    cases = [(PROMPTS[0], sampled(drafter, 11)), (PROMPTS[2], sampled(drafter, 12))]
    expected = [gen.generate(prompt, config).text for prompt, config in cases]
    pieces = [[], []]
    for step in zip_longest(*(gen.stream(prompt, config) for prompt, config in cases)):
        for kept, piece in zip(pieces, step):
            kept.append(piece or "")
    assert ["".join(kept) for kept in pieces] == expected


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_suspended_seeded_stream_reproduces_generate(gen, drafter):
    config = sampled(drafter, 31)
    expected = gen.generate(PROMPTS[1], config).text
    shown = ""
    for index, piece in enumerate(gen.stream(PROMPTS[1], config)):
        shown += piece
        other = DRAFTERS[index % len(DRAFTERS)]  # other requests, sampled and greedy, use the models meanwhile
        gen.generate(PROMPTS[3], sampled(other, index) if index % 2 else GenerationConfig(max_new_tokens=6))
    assert shown == expected


def test_eight_threads_of_seeded_streams_reproduce_generate(gen):
    cases = [(PROMPTS[i % len(PROMPTS)], sampled(DRAFTERS[i % len(DRAFTERS)], 40 + i)) for i in range(8)]
    expected = [gen.generate(prompt, config).text for prompt, config in cases]
    got, errors, start = [None] * len(cases), [], threading.Barrier(len(cases))

    def worker(index: int) -> None:
        try:
            start.wait()
            pieces = []
            for piece in gen.stream(*cases[index]):
                pieces.append(piece)
                time.sleep(0.001)  # hand the generator to another thread between rounds
            got[index] = "".join(pieces)
        except Exception as exc:  # noqa: BLE001 - any failure of a worker fails the test below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and got == expected


def test_interleaved_seeded_requests_keep_the_target_distribution_at_every_draft_position(gen):
    """χ² of the first three tokens (γ = 3: drafts verified at positions 0, 1, 2) of seeded model-drafted requests
    whose every round alternates with another request's (each resumes with a prefill again)."""
    samples = SAMPLES
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="model", eos_token_ids=(), **TOP_K)
    ids, other_ids = gen.requests.prompt_ids(PROMPT), gen.requests.prompt_ids(PROMPTS[2])
    counts, proposed, accepted = {}, [0] * 3, [0] * 3
    for seed in range(samples):
        request = gen.request([ids], dataclasses.replace(config, seed=seed))
        other = gen.request([other_ids], GenerationConfig(max_new_tokens=2, drafter="none"))
        for _ in zip_longest(gen.rounds(request), gen.rounds(other)):
            pass
        key = window(request.rows[0].tokens[len(ids) :])
        counts[key] = counts.get(key, 0) + 1
        for i in range(min(3, len(request.stats.position_proposed))):
            proposed[i] += request.stats.position_proposed[i]
            accepted[i] += request.stats.position_accepted[i]
    assert proposed[2] > 100 and accepted[1] > 50, (proposed, accepted)  # every draft position was verified
    assert p_value(exact_joint(gen, ids, config), counts) > 1e-3


def _complete(url: str, model: str, prompt: str, config: GenerationConfig, stream: bool) -> str:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": config.max_new_tokens, "temperature": config.temperature,
            "seed": config.seed, "specdec": {"drafter": config.drafter, "top_k": config.top_k}, "stream": stream}
    if not stream:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return "".join(chunk["choices"][0]["text"] for chunk in map(json.loads, lines[:-1]) if chunk["choices"])


def test_served_seeded_requests_reproduce_generate_and_run_their_calls_alone(backend_bundle, gen):
    """Eight seeded sampled requests at once on four rows, every drafter, streamed or not: each equals offline
    generate, and no forward call of either model ever holds a seeded row together with another row."""
    from specdec.serving.engine import Engine
    from specdec.serving.options import ServeOptions
    from specdec.serving.server import BackgroundServer
    from specdec.serving.app import build_app

    backend, bundle = backend_bundle
    cases = [(PROMPTS[i % len(PROMPTS)], sampled(DRAFTERS[i % len(DRAFTERS)], 60 + i)) for i in range(8)]
    expected = [gen.generate(prompt, config).text for prompt, config in cases]
    options = ServeOptions(bundle=str(bundle), port=0, backend=backend)
    engine = Engine.from_options(options).start()
    shared = []  # calls that held a seeded row with another row: (model, slots)
    for role, timed in (("target", engine.gen.target), ("draft", engine.gen.draft)):
        _spy(timed.backend, role, engine, shared)
    try:
        with BackgroundServer(options, app=build_app(options, engine)) as server, ThreadPoolExecutor(8) as pool:
            name = Path(bundle).name
            got = list(pool.map(lambda i: _complete(server.url, name, *cases[i], i % 2 == 1), range(len(cases))))
    finally:
        engine.close()
    assert got == expected
    assert not shared, shared[:5]


def _spy(backend, role: str, engine, shared: list) -> None:
    """Record every forward call of `backend` whose slots hold a seeded row (ServingLoop.alone) with another."""
    original = backend.run

    def run(request):
        listed = [] if request.slots is None else [int(s) for s in request.slots]
        if len(listed) > 1 and set(listed) & set(engine.loop.alone):
            shared.append((role, listed))
        return original(request)

    backend.run = run


# --- each option checked once, by the request layer; serving uses public API only -------------------------------
def _private_generator_members(path: Path) -> list:
    """`gen._x`, `self.gen._x`, `generator._x` and the like in a source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("gen", "generator"):
                found.append(f"{path.name}:{node.lineno}: {name}.{node.attr}")
    return found


def _generator_reached(path: Path) -> list:
    """`engine.gen`, `self.gen` and any other `.gen` in a source file: the engine's generator, reached through."""
    return [f"{path.name}:{node.lineno}: .gen" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "gen"]


def test_serving_uses_only_the_generators_public_api_and_checks_no_request_option_itself():
    private = [hit for path in sorted(SERVING.glob("*.py")) for hit in _private_generator_members(path)]
    assert private == []
    # the app and the server prepare requests through the engine's request layer (Engine.requests), never its generator
    reached = [hit for path in sorted(SERVING.glob("*.py")) if path.name != "engine.py"
               for hit in _generator_reached(path)]
    assert reached == []
    own_checks = []  # request options are refused by GenerationConfig and the request layer, not by serving code
    for path in sorted(SERVING.glob("*.py")):
        if path.name in ("options.py", "ray_app.py"):  # the server's and the deployment's own options
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                called = getattr(node.exc.func, "id", "")
                if called in ("ConfigError", "CapacityError", "OptionError", "RequestCapacityError"):
                    own_checks.append(f"{path.name}:{node.lineno}")
    assert own_checks == []


def test_gamma_above_gamma_max_is_refused_in_one_place_for_requests_and_serve(gen, backend_bundle, capsys):
    from specdec.cli import main
    from specdec.serving.engine import Engine
    from specdec.serving.options import ServeOptions

    gamma_max = gen.manifest.defaults.gamma_max
    with pytest.raises(ConfigError, match="exceeds this bundle's gamma_max") as offline:
        gen.generate("x", GenerationConfig(gamma=gamma_max + 1))
    backend, bundle = backend_bundle
    with pytest.raises(ConfigError, match="exceeds this bundle's gamma_max") as served:  # serve --gamma 99
        Engine.from_options(ServeOptions(bundle=str(bundle), backend=backend, gamma=99))
    assert offline.value.hint == served.value.hint and "--gamma-max" in served.value.hint
    assert main(["serve", str(bundle), "--backend", backend, "--port", "0", "--gamma", "99"]) == 1
    err = capsys.readouterr().err
    assert "gamma 99 exceeds this bundle's gamma_max" in err and "Hint:" in err and "Traceback" not in err


def test_absurd_thread_counts_are_refused_before_anything_opens(gqa_int4_bundle):
    from specdec.runtime.generator import max_threads
    from specdec.serving.options import ServeOptions

    for threads in (10**6, max_threads() + 1, 0, -2, True):
        with pytest.raises(ConfigError, match="threads") as info:
            specdec.load(gqa_int4_bundle, threads=threads)
        assert "leave threads unset" in info.value.hint
        with pytest.raises(ConfigError, match="threads"):
            ServeOptions(bundle=str(gqa_int4_bundle), threads=threads)
    with specdec.load(gqa_int4_bundle, threads=np.int64(1)) as generator:
        assert generator.generate("The quick", GenerationConfig(max_new_tokens=3)).token_ids


def test_numpy_scalars_are_numbers_and_bools_are_not():
    config = GenerationConfig(max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(2),
                              top_p=np.float64(0.9), seed=np.uint8(3), gamma=np.int16(2),
                              eos_token_ids=np.array([2, 5]), lookup_ngram=np.int64(4))
    assert config.max_new_tokens == 3 and type(config.max_new_tokens) is int and type(config.seed) is int
    assert config.temperature == 0.5 and type(config.temperature) is float and type(config.top_p) is float
    assert config.eos_token_ids == (2, 5) and all(type(t) is int for t in config.eos_token_ids)
    assert json.dumps(dataclasses.asdict(config))  # plain Python values throughout
    for bad in (dict(top_k=True), dict(seed=np.bool_(True)), dict(temperature=False), dict(max_new_tokens=3.0)):
        with pytest.raises(ConfigError) as info:
            GenerationConfig(**bad)
        assert info.value.hint


@pytest.fixture(scope="module")
def edited_bundle(tmp_path_factory, gqa_int4_bundle):
    """The gqa bundle with a tokenizer that knows one more word than the models (id = vocab size), and a default
    top_k of 2 in its manifest."""
    from tokenizers import Tokenizer

    copy = tmp_path_factory.mktemp("edited") / "edited"
    shutil.copytree(gqa_int4_bundle, copy)
    tokenizer = Tokenizer.from_file(str(copy / "tokenizer.json"))
    tokenizer.add_tokens(["zqzqzq"])
    tokenizer.save(str(copy / "tokenizer.json"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["defaults"]["top_k"] = 2
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.fixture(scope="module")
def edited_server(edited_bundle):
    from specdec.serving.options import ServeOptions
    from specdec.serving.server import BackgroundServer

    with BackgroundServer(ServeOptions(bundle=str(edited_bundle), port=0, verify_files=False)) as server:
        yield server


def test_text_prompt_ids_outside_the_vocabulary_are_refused(edited_bundle, edited_server):
    import httpx

    with specdec.load(edited_bundle, verify=False) as generator:
        vocab = generator.manifest.target.dims.vocab_size
        assert generator.codec.encode("zqzqzq") == [vocab]  # the swapped tokenizer's word
        for chat in (False, True):
            with pytest.raises(ConfigError, match="the tokenizer gave token id") as info:
                generator.generate("hello zqzqzq", GenerationConfig(max_new_tokens=3, chat=chat))
            assert "tokenizer files do not belong" in info.value.hint
        assert generator.generate("hello", GenerationConfig(max_new_tokens=3)).token_ids
    for path, body in (("/v1/completions", {"prompt": "hello zqzqzq"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "zqzqzq"}]})):
        response = httpx.post(edited_server.url + path, json={"model": "edited", "max_tokens": 3, **body}, timeout=60)
        assert response.status_code == 400 and "outside the vocabulary" in response.json()["error"]["message"]


def test_a_clients_top_k_0_turns_a_bundle_default_off(edited_bundle, edited_server):
    config = dataclasses.replace(sampled("auto", 7), top_k=0)
    with specdec.load(edited_bundle, verify=False) as generator:
        off = generator.generate(PROMPTS[0], config).text
        assert off != generator.generate(PROMPTS[0], dataclasses.replace(config, top_k=2)).text
    assert _complete(edited_server.url, "edited", PROMPTS[0], config, stream=False) == off


def test_refusals_sent_to_clients_never_echo_what_they_sent(gqa_int4_bundle):
    """The seed, γ, the model name, a token id and a lone surrogate a client sent never come back."""
    import httpx
    from specdec.serving.options import ServeOptions
    from specdec.serving.server import BackgroundServer

    good = {"model": "gqa", "prompt": "The quick", "max_tokens": 3}
    cases = [({**good, "seed": -987654321}, "987654321"), ({**good, "specdec": {"gamma": 424242}}, "424242"),
             ({**good, "model": "zz-secret-name"}, "zz-secret-name"), ({**good, "prompt": [1, 987654321]}, "987654321"),
             ({**good, "temperature": -0.123456}, "123456"), ({**good, "specdec": {"drafter": "medusa-x"}}, "medusa"),
             ({**good, "prompt": "caf\udce9"}, "\\udce9"), ({**good, "specdec": {"top_k": -77777}}, "77777")]
    chat = {"model": "gqa", "messages": [{"role": "user", "content": "caf\udce9"}]}
    with BackgroundServer(ServeOptions(bundle=str(gqa_int4_bundle), port=0)) as server:
        for body, sent in cases + [(chat, "\\udce9")]:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            raw = json.dumps(body).encode()  # json escapes the lone surrogate as \udce9
            response = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, response.text
            message = response.json()["error"]["message"]
            assert message and sent not in response.text and "\udce9" not in message, (body, response.text)
