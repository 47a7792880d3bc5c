# Source from the repository root on a GPU host where the project cannot be pip-installed
# (offline image): maps the top-level folders onto the tinyloop.* namespace with symlinks,
# which is what setuptools' package-dir mapping does for an installed checkout.
#   source bench/gpu_env.sh && python -m tinyloop.cli --help
_tl_root=$(mktemp -d)/tinyloop
mkdir -p "$_tl_root"
for _d in cli worker kernels client gateway train; do ln -s "$PWD/$_d" "$_tl_root/$_d"; done
export PYTHONPATH="$(dirname "$_tl_root"):$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset _tl_root _d
