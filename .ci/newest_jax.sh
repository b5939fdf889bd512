#!/bin/bash
# The test suite on the newest jax that pyproject.toml allows (.ci/run: $JAX_RANGE_TESTS).
# jax 0.11 and later need Python >= 3.12, which this Debian 12 machine lacks: this takes
# Debian 13's Python 3.13 from its packages, unpacked into a folder (never installed: its
# libc is newer than the system's, so it runs under its own loader), installs that jax
# there with pip and runs pytest with it.
#
#     bash .ci/newest_jax.sh                    # jax 0.12.0.1, the fast tier
#     bash .ci/newest_jax.sh -m slow
#     JAX_VERSION=0.11.2 FLAX_VERSION=0.12.10 bash .ci/newest_jax.sh
#
# Run from the repository root; extra arguments go to pytest (a jax past the pin fails
# tests/test_jax_dims.py::test_jax_version_is_in_the_tested_range: --deselect it to try one).
set -euo pipefail
JAX_VERSION=${JAX_VERSION:-0.12.0.1}
FLAX_VERSION=${FLAX_VERSION:-0.12.12}
ROOT=${NEWEST_JAX_DIR:-/tmp/newest_jax}
mkdir -p "$ROOT/lists/partial" "$ROOT/cache/archives/partial" "$ROOT/debs" "$ROOT/root"
echo "deb [trusted=yes] https://deb.debian.org/debian trixie main" > "$ROOT/sources.list"
touch "$ROOT/status"
apt_opts=(-o Dir::Etc::sourcelist="$ROOT/sources.list" -o Dir::Etc::sourceparts=-
          -o Dir::State::Lists="$ROOT/lists" -o Dir::State::status="$ROOT/status"
          -o Dir::Cache="$ROOT/cache")
if [ ! -x "$ROOT/root/usr/bin/python3.13" ]; then
  apt-get "${apt_opts[@]}" -q update >/dev/null
  # Python and what it links, as Debian 13 resolves it; the packages only the installer
  # needs (debconf and its front ends, tzdata) stay out.
  pkgs=$(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
      --no-conflicts --no-breaks --no-replaces --no-enhances python3.13 python3.13-venv \
      | grep -v '^ \|<' | sort -u | grep -v 'debconf\|libdebian-installer\|libnewt\|libslang\|libtextwrap\|tzdata')
  (cd "$ROOT/debs" && apt-get "${apt_opts[@]}" -q download $pkgs libstdc++6 >/dev/null)
  for f in "$ROOT"/debs/*.deb; do dpkg -x "$f" "$ROOT/root"; done
fi
lib="$ROOT/root/usr/lib/x86_64-linux-gnu"
cat > "$ROOT/python" <<EOF
#!/bin/bash
export PYTHONHOME=$ROOT/root/usr
exec $lib/ld-linux-x86-64.so.2 --argv0 "\$0" --library-path $lib $ROOT/root/usr/bin/python3.13 "\$@"
EOF
chmod +x "$ROOT/python"
# A folder named site-packages: the planner tells library frames from the user's by it.
site="$ROOT/lib/site-packages"
mkdir -p "$site"
echo "$site" > "$ROOT/root/usr/lib/python3/dist-packages/newest_jax.pth"
pip_wheel=$(ls "$ROOT"/root/usr/share/python-wheels/pip-*.whl)
"$ROOT/python" "$pip_wheel/pip" install -q --target "$site" \
    --upgrade "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" "flax==$FLAX_VERSION" sympy chex \
    absl-py optax matplotlib pytest pytest-xdist hypothesis "equinox>=0.13,<0.14" nbclient \
    nbformat ipykernel 2>&1 | { grep -v '^WARNING' || true; }
"$ROOT/python" -c "import sys, jax, jaxlib, flax; print(sys.version.split()[0], jax.__version__, jaxlib.__version__, flax.__version__)"
PYTHONPATH=$PWD "$ROOT/python" -m pytest -q -p no:cacheprovider "$@"
