"""Build fattn._C: the C extension (csrc/*.c and the kernel families' planners, kernels/*/*.c) linked with the CUDA
kernels (kernels/*/*.cu) compiled by nvcc.

Kernels live in a folder per GPU family (kernels/simt, kernels/sm80, kernels/sm90, ...).  A family folder may hold a
file `gencode` naming the nvcc -gencode values its .cu files are built for (kernels/sm90: sm_90a only, for wgmma);
the others are built for FATTN_CUDA_ARCHS.

Environment:
  CUDA_HOME          CUDA toolkit root (default: the one holding nvcc on PATH, or /usr/local/cuda)
  FATTN_CUDA_ARCHS   semicolon-separated nvcc -gencode values (default: sm_80, sm_90 and compute_90 PTX)
  FATTN_NO_CUDA=1    build the CPU backend only (seconds instead of minutes; GPU calls then raise)
  FATTN_CPU_ARCH     -march value for the CPU backend (default: native)
  FATTN_NVCC_JOBS    parallel nvcc processes (default: number of CPUs)
"""
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "arch=compute_80,code=sm_80;arch=compute_90,code=sm_90;arch=compute_90,code=compute_90"


def find_cuda():
    """(nvcc path, toolkit root) or (None, None)."""
    if os.environ.get("FATTN_NO_CUDA") == "1":
        return None, None
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    if shutil.which("nvcc"):
        candidates.append(shutil.which("nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    try:  # PyPI's nvidia-cuda-nvcc wheel
        import nvidia.cuda_nvcc  # noqa: F401

        candidates.append(os.path.join(os.path.dirname(nvidia.cuda_nvcc.__file__), "bin", "nvcc"))
    except ImportError:
        pass
    for nvcc in candidates:
        if not os.path.isfile(nvcc):
            continue
        nvcc = os.path.realpath(nvcc)
        for root in filter(None, [os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(nvcc)), "/usr/local/cuda"]):
            if os.path.isfile(os.path.join(root, "include", "cuda_runtime_api.h")):
                return nvcc, root
    return None, None


def cuda_lib_dir(root):
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if os.path.isfile(os.path.join(root, sub, "libcudart_static.a")):
            return os.path.join(root, sub)
    raise RuntimeError(f"libcudart_static.a not found under {root}")


class BuildExt(build_ext):
    def build_extension(self, ext):
        nvcc, root = find_cuda()
        if nvcc:
            ext.define_macros.append(("FATTN_WITH_CUDA", "1"))
            ext.include_dirs.append(os.path.join(root, "include"))
            objects = self.compile_kernels(nvcc, root)
            ext.extra_objects.extend(objects)
            ext.depends.extend(objects)  # relink when a kernel object changed (setuptools only checks these)
            ext.library_dirs.append(cuda_lib_dir(root))
            ext.libraries.extend(["cudart_static", "rt", "dl", "pthread", "stdc++"])
        else:
            print("fattn: nvcc not found: building the CPU backend only (GPU calls will raise)", file=sys.stderr)
        super().build_extension(ext)

    def compile_kernels(self, nvcc, root):
        archs = os.environ.get("FATTN_CUDA_ARCHS", DEFAULT_ARCHS).split(";")
        out_dir = os.path.join(self.build_temp, "kernels")
        os.makedirs(out_dir, exist_ok=True)
        sources = sorted(glob.glob(os.path.join(ROOT, "kernels", "*", "*.cu")))
        headers = sorted(f for pat in ("kernels/*.cuh", "kernels/*/*.cuh", "kernels/*/*.h", "csrc/*.h")
                         for f in glob.glob(os.path.join(ROOT, pat)))
        header_bytes = b"".join(open(h, "rb").read() for h in headers)
        # The compiler enters the rebuild key by its release, not its path: the same nvcc reached through another path
        # (a wrapper script, /usr/local/cuda-13.0/bin) makes the same objects, so objects built on one machine are
        # reused on another with the same release.
        release = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-2:]
        done = []

        def gencodes(src):
            path = os.path.join(os.path.dirname(src), "gencode")
            return open(path).read().split() if os.path.exists(path) else archs

        def one(src):
            family = os.path.basename(os.path.dirname(src))
            obj = os.path.join(out_dir, family + "_" + os.path.basename(src) + ".o")
            cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo", "-Xptxas=-warn-spills",
                   f"-I{os.path.join(ROOT, 'csrc')}", "-c", src, "-o", obj]
            cmd += [f"-gencode={g}" for g in gencodes(src)]
            # Rebuild unless the source, every header and the command are byte-identical to the last build's
            # (contents, not mtimes: trees copied between machines keep stale mtimes).
            # The key names paths relative to the tree, so objects carried to another checkout are reused.
            flags = release + [c.replace(ROOT, ".") for c in cmd[1:] if c not in (obj, "-o")]
            key = hashlib.sha256(open(src, "rb").read() + header_bytes + " ".join(flags).encode()).hexdigest()
            stamp = obj + ".sha256"
            if not (os.path.exists(obj) and os.path.exists(stamp) and open(stamp).read() == key):
                print(" ".join(cmd), flush=True)
                subprocess.check_call(cmd)
                with open(stamp, "w") as f:
                    f.write(key)
            done.append(src)
            print(f"fattn: kernels {len(done)}/{len(sources)} compiled ({os.path.relpath(src, ROOT)})",
                  file=sys.stderr, flush=True)
            return obj

        jobs = int(os.environ.get("FATTN_NVCC_JOBS", os.cpu_count() or 1))
        print(f"fattn: compiling {len(sources)} CUDA kernel files with nvcc ({jobs} at a time; a few minutes on a "
              "small machine; FATTN_NO_CUDA=1 skips them)", file=sys.stderr, flush=True)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, sources))


cflags = ["-O3", "-std=gnu11", "-fopenmp", f"-march={os.environ.get('FATTN_CPU_ARCH', 'native')}",
          "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]
if sysconfig.get_config_var("CC") and "clang" in sysconfig.get_config_var("CC"):
    cflags.remove("-fopenmp")

setup(
    ext_modules=[
        Extension(
            "fattn._C",
            sources=sorted(glob.glob("csrc/*.c") + glob.glob("kernels/*/*.c")),
            include_dirs=["csrc"],
            depends=sorted(glob.glob("csrc/*.h") + glob.glob("kernels/*/*.h")),
            extra_compile_args=cflags,
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
