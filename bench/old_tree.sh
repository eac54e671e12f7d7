#!/usr/bin/env bash
# old_tree.sh SRC OUT -- an older checkout of fattn (SRC: its files, e.g. from `git archive`) built as the package
# fattn_old in OUT, so that bench/ab.py can time it beside this tree in one process (old:VARIANT candidates).
# The extension is renamed fattn_old._C; its kernels are built for FATTN_CUDA_ARCHS (default sm_90).  Log: OUT/build.log.
set -euo pipefail
SRC=${1:?usage: old_tree.sh SRC OUT}
OUT=${2:?usage: old_tree.sh SRC OUT}
rm -rf "$OUT"
mkdir -p "$OUT"
cp -r "$SRC"/. "$OUT"/
cd "$OUT"
mv fattn fattn_old
sed -i 's/"fattn\._C"/"fattn_old._C"/' setup.py
grep -q '"fattn_old._C"' setup.py || { echo "old_tree.sh: setup.py does not name fattn._C"; exit 1; }
# its torch ops under their own namespace, so both trees' autograd can run in one process
if [ -f fattn_old/_torch.py ]; then sed -i 's/^_LIB = "fattn"$/_LIB = "fattn_old"/' fattn_old/_torch.py; fi
FATTN_CUDA_ARCHS="${FATTN_CUDA_ARCHS:-arch=compute_90,code=sm_90}" python3 setup.py build_ext --inplace > build.log 2>&1 \
  || { tail -20 build.log; exit 1; }
python3 -c 'import sys; sys.path.insert(0, "."); import fattn_old; print("fattn_old built:", fattn_old.variants("cuda"))'
