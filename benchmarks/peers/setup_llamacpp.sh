#!/usr/bin/env bash
# Builds llama.cpp from source with native CPU flags into benchmarks/.peers/llama.cpp/ (git-ignored):
#   src/llama_cpp_python-<V>/vendor/llama.cpp   the tree that PyPI's llama-cpp-python sdist vendors (its shallow git
#                                                metadata too, so the binaries report the commit they were built from)
#   build/bin/llama-server, llama-bench, llama-quantize   Release, -DGGML_NATIVE=ON, static, nothing else built
#   version.json     the sdist version, llama.cpp's commit and subject, the cmake flags, `llama-server --version`
# Nothing of llama.cpp is committed. The converter (convert_hf_to_gguf.py) runs from src/ (make_bf16_gguf.py).
# Idempotent: an existing build is kept unless the version or the flags change.
# Usage: benchmarks/peers/setup_llamacpp.sh   (env: LLAMA_CPP_PYTHON_VERSION, JOBS, SPECDEC_PEERS_DIR, PYTHON, LLAMA_AMX)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
peers=${SPECDEC_PEERS_DIR:-$root/benchmarks/.peers}
python=${PYTHON:-python3}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
jobs=${JOBS:-2}
dest=$peers/llama.cpp
tree=$dest/src/llama_cpp_python-$version/vendor/llama.cpp
flags=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF
       -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF)  # no web UI and no download at build time
targets=(llama-server llama-bench llama-quantize)
# AMX: GGML_NATIVE compiles ggml's AMX products where the CPU has AMX; in this version llama-server then segfaults
# in ggml_backend_amx_mul_mat at its first batch (seen on a 2-core Xeon VM with amx_tile / amx_int8; llama-bench
# runs). So where the CPU has AMX the build leaves it out unless LLAMA_AMX=on; the flags go into version.json.
if grep -q amx_tile /proc/cpuinfo 2>/dev/null && [ "${LLAMA_AMX:-off}" != on ]; then
  flags+=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
          "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
mkdir -p "$dest/src"

if [ ! -f "$tree/CMakeLists.txt" ]; then
  echo "[llama.cpp] llama-cpp-python==$version sdist" >&2
  "$python" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$dest/src"
  tar -xzf "$dest/src/llama_cpp_python-$version.tar.gz" -C "$dest/src"
fi

stamp="$version ${flags[*]} ${targets[*]}"
if [ "$(cat "$dest/.ready" 2>/dev/null)" != "$stamp" ]; then
  echo "[llama.cpp] cmake ${flags[*]}" >&2
  cmake -S "$tree" -B "$dest/build" "${flags[@]}" >"$dest/cmake.log"
  echo "[llama.cpp] building ${targets[*]} with -j$jobs (takes a while on 2 cores)" >&2
  cmake --build "$dest/build" --target "${targets[@]}" -j "$jobs" >"$dest/build.log"
  echo "$stamp" > "$dest/.ready"
fi

commit=$(git -C "$tree" rev-parse HEAD 2>/dev/null || echo unknown)
subject=$(git -C "$tree" log -1 --format=%s 2>/dev/null || echo unknown)
server_version=$("$dest/build/bin/llama-server" --version 2>&1 | tr '\n' ' ')
"$python" - "$dest/version.json" "$version" "$commit" "$subject" "$server_version" "${flags[@]}" <<'EOF'
import json, sys
path, version, commit, subject, server, *flags = sys.argv[1:]
json.dump({"llama_cpp_python_sdist": version, "commit": commit, "subject": subject,
           "server_version": " ".join(server.split()), "cmake_flags": flags,
           "note": "the sdist's git metadata is a shallow clone: the build number it reports is not llama.cpp's"},
          open(path, "w"), indent=2)
EOF
echo "[llama.cpp] done: $dest/build/bin ($(cat "$dest/version.json" | tr -d '\n' | cut -c1-200))" >&2
