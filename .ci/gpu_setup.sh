# Sourced by the GPU machine's scripts (gpu_check.sh, gpu_soak.sh, gpu_jobs.sh): unpacks the .debs carried in
# .carry/ (GoogleTest, oneDNN and the OpenCL loader oneDNN links against; that machine has no registries),
# then installs .carry/ember-prebuilt.tgz where it matches the tree (.ci/prebuilt.sh), else builds ember and
# packs the build into $OUT/ember-prebuilt.tgz for the next call (copy it into .carry/). Fetch the .debs once:
#   mkdir -p .carry && (cd .carry && apt-get download libgtest-dev libdnnl2 libdnnl-dev ocl-icd-libopencl1)
OUT=${OUT:-/tmp/ember_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for deb in .carry/libgtest-dev_*.deb .carry/libdnnl2_*.deb .carry/libdnnl-dev_*.deb .carry/ocl-icd-libopencl1_*.deb; do
  [ -f "$deb" ] && dpkg -x "$deb" /tmp/debs
done
if [ -d /tmp/debs/usr ]; then
  export GTest_ROOT=/tmp/debs/usr dnnl_ROOT=/tmp/debs/usr
  export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# pytest-xdist, where that machine lacks it, as wheels: (cd .carry && pip download -d wheels --no-deps pytest-xdist execnet)
if ls .carry/wheels/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index .carry/wheels/*.whl; fi
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/device.txt"
setup_start=$(date +%s)
if bash .ci/prebuilt.sh unpack .carry/ember-prebuilt.tgz && python3 -c "import ember._native" 2>/dev/null; then
  echo "build: prebuilt, $(( $(date +%s) - setup_start )) s"
else
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) bash .ci/install.sh > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - setup_start )) s"
  bash .ci/prebuilt.sh pack "$OUT/ember-prebuilt.tgz"
fi
