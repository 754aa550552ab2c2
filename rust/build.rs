//! Builds ggml's quantized CPU kernels from ggml's own sources.
//!
//! The sources come from llama-cpp-python's sdist on PyPI (pinned by version
//! and sha256 in `rust/ggml_sources.py`, which this script runs with the
//! build's Python; the sdist is cached in `~/.cache/guided`), or from
//! wherever `GGML_SRC` points (a ggml directory with `include/` and `src/`).
//! So `pip install .`, `pip wheel .`, `maturin build` and `cargo build` work
//! on a clean clone. Two pieces are compiled:
//!
//! * ggml-base at the baseline ISA: the row formats, `dequantize_row_*` and
//!   the reference quantizers (`ggml-quants.c`) with what they link against.
//! * ggml-cpu's x86 dot products and activation quantizers
//!   (`ggml-cpu/arch/x86/quants.c`) once per ISA level, each copy's public
//!   names prefixed with its level (`guided_avx2_ggml_vec_dot_q4_1_q8_1`).
//!   The Rust side (`rust/cpu/quant.rs`) picks the best level the CPU has at run
//!   time, so one build runs on AVX2-only and AVX-512 machines alike.
//!
//! With the `cuda` feature it also compiles the kernels in `cuda/` with nvcc
//! into one fatbin per file (machine code for sm_80 and sm_90, and sm_90 PTX
//! that newer GPUs compile at load), which `rust/cuda/launchers.rs` embeds. nvcc is
//! found through `GUIDED_NVCC`, the build's Python environment
//! (`nvidia-cuda-nvcc` from PyPI, which `make test` installs), or PATH.
//! Without nvcc the module is built without the kernels, with a warning;
//! `rust/cuda/launchers.rs` then reports why at run time (`--device cuda` runs the
//! torch path and says so).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

/// ISA levels with their compiler flags and the defines ggml's CMake sets for them.
const LEVELS: &[(&str, &[&str], &[&str])] = &[
    ("avx2", &["-mavx2", "-mfma", "-mf16c", "-mbmi2"], &["GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"]),
    (
        "avx512",
        &["-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"],
        &["GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX512", "GGML_AVX512_VNNI"],
    ),
];

const BASE_C: &[&str] = &["ggml.c", "ggml-alloc.c", "ggml-quants.c"];
const BASE_CPP: &[&str] = &["ggml.cpp", "ggml-backend.cpp", "ggml-backend-meta.cpp", "ggml-threading.cpp"];
const KERNELS: &str = "ggml-cpu/arch/x86/quants.c";

fn main() {
    println!("cargo:rerun-if-changed=rust/ggml_tables.c");
    println!("cargo:rerun-if-changed=rust/ggml_sources.py");
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let src = ggml_sources(&root, &out);
    // ggml.c includes a header CMake generates from a template; its version strings are all it holds
    let template = fs::read_to_string(src.join("src/ggml-version.h.in")).expect("ggml-version.h.in");
    fs::write(out.join("ggml-version.h"), template.replace("@GGML_VERSION@", "guided").replace("@GGML_BUILD_COMMIT@", "sdist"))
        .unwrap();

    let base = |cpp: bool| {
        let mut b = cc::Build::new();
        b.cpp(cpp)
            .opt_level(3)
            .warnings(false)
            .include(src.join("include"))
            .include(src.join("src"))
            .include(&out)
            .define("_GNU_SOURCE", None)
            .define("NDEBUG", None)
            .flag_if_supported(if cpp { "-std=c++17" } else { "-std=c11" });
        b
    };
    let mut c = base(false);
    c.files(BASE_C.iter().map(|f| src.join("src").join(f))).file(root.join("rust/ggml_tables.c"));
    c.include(src.join("src/ggml-cpu"));
    c.compile("ggml_base_c");
    base(true).files(BASE_CPP.iter().map(|f| src.join("src").join(f))).compile("ggml_base_cpp");

    if env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64") {
        let names = public_names(&src.join("src").join(KERNELS));
        for (level, flags, defines) in LEVELS {
            let header = out.join(format!("guided_{level}_names.h"));
            let renames: String = names.iter().map(|n| format!("#define {n} guided_{level}_{n}\n")).collect();
            fs::write(&header, renames).unwrap();
            let mut k = base(false);
            k.include(src.join("src/ggml-cpu")).file(src.join("src").join(KERNELS)).flag("-include").flag(header.to_str().unwrap());
            for f in *flags {
                k.flag(f);
            }
            for d in *defines {
                k.define(d, None);
            }
            k.compile(&format!("ggml_kernels_{level}"));
        }
    }
    println!("cargo:rustc-link-lib=stdc++");
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        compile_cuda(&root, &out);
    }
}

/// The GPU architectures the fatbin holds machine code for, and the PTX
/// kept for later ones.
const CUDA_ARCHS: &[&str] = &["arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90"];

fn compile_cuda(root: &Path, out: &Path) {
    println!("cargo:rerun-if-env-changed=GUIDED_NVCC");
    println!("cargo:rerun-if-changed=cuda");
    let Some(nvcc) = find_nvcc() else {
        let why = "this build of guided has no CUDA kernels: nvcc was not found when it was built \
                   (pip install nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt into the build's environment, \
                   or set GUIDED_NVCC, and build again)";
        println!("cargo:warning={why}");
        println!("cargo:rustc-env=GUIDED_NO_CUDA_KERNELS={why}");
        fs::write(out.join("cuda_fatbins.rs"), "&[]").unwrap();
        return;
    };
    println!("cargo:rerun-if-changed={}", nvcc.display());
    let mut sources: Vec<PathBuf> = fs::read_dir(root.join("cuda"))
        .expect("cuda/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    // one fatbin per file, then one embedded blob per file (rust/cuda/launchers.rs)
    let mut listing = String::new();
    for src in &sources {
        let stem = src.file_stem().unwrap().to_str().unwrap();
        let target = out.join(format!("{stem}.fatbin"));
        let mut cmd = std::process::Command::new(&nvcc);
        cmd.arg("-fatbin").arg("-O3").arg("-std=c++17").arg("-I").arg(root.join("cuda"));
        for arch in CUDA_ARCHS {
            cmd.arg("-gencode").arg(arch);
        }
        cmd.arg(src).arg("-o").arg(&target);
        let status = cmd.status().unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {}", src.display());
        listing.push_str(&format!("(\"{stem}\", include_bytes!(\"{}\")),\n", target.display()));
    }
    fs::write(out.join("cuda_fatbins.rs"), format!("&[\n{listing}]")).unwrap();
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("GUIDED_NVCC").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    // nvidia-cuda-nvcc's place in the build's Python environment: the active
    // venv, or the interpreter maturin builds for (`pip install .` sets no
    // VIRTUAL_ENV). Where it is not installed, the build is run again when
    // pip adds it: the deepest existing folder on its way is watched.
    let prefixes = [env::var_os("VIRTUAL_ENV").map(PathBuf::from), python_prefix()];
    for prefix in prefixes.into_iter().flatten() {
        let Ok(libs) = fs::read_dir(prefix.join("lib")) else { continue };
        for lib in libs.flatten() {
            let site = lib.path().join("site-packages");
            if !site.is_dir() {
                continue;
            }
            let nvcc = site.join("nvidia/cu13/bin/nvcc");
            if nvcc.exists() {
                return Some(nvcc);
            }
            let watched = ["nvidia/cu13/bin", "nvidia/cu13", "nvidia"].iter().map(|d| site.join(d)).find(|d| d.is_dir());
            println!("cargo:rerun-if-changed={}", watched.unwrap_or(site).display());
        }
    }
    env::var_os("PATH").and_then(|paths| env::split_paths(&paths).map(|d| d.join("nvcc")).find(|p| p.exists()))
}

/// The prefix of the Python maturin builds for (`PYO3_PYTHON`: `<prefix>/bin/python`).
fn python_prefix() -> Option<PathBuf> {
    let python = PathBuf::from(env::var_os("PYO3_PYTHON")?);
    Some(python.parent()?.parent()?.to_path_buf())
}

/// A ggml source directory: `GGML_SRC`, or the pinned sdist's ggml unpacked
/// into OUT_DIR by `rust/ggml_sources.py` (run with the build's Python).
fn ggml_sources(root: &Path, out: &Path) -> PathBuf {
    println!("cargo:rerun-if-env-changed=GGML_SRC");
    if let Some(src) = env::var_os("GGML_SRC").filter(|p| !p.is_empty()).map(PathBuf::from) {
        assert!(src.join("src").join(KERNELS).exists(), "GGML_SRC={}: no ggml sources there", src.display());
        println!("cargo:rerun-if-changed={}", src.display());
        return src;
    }
    let src = out.join("ggml");
    if src.join("src").join(KERNELS).exists() {
        return src;
    }
    let python = env::var_os("PYO3_PYTHON").unwrap_or_else(|| "python3".into());
    let status = std::process::Command::new(&python)
        .arg(root.join("rust/ggml_sources.py"))
        .arg(out)
        .status()
        .unwrap_or_else(|e| panic!("running {} rust/ggml_sources.py: {e} (or set GGML_SRC to a ggml directory)", python.to_string_lossy()));
    assert!(status.success(), "rust/ggml_sources.py could not unpack ggml's sources (or set GGML_SRC to a ggml directory)");
    src
}

/// The functions the kernel file defines for other files (dot products and
/// activation quantizers), read from its definitions.
fn public_names(path: &Path) -> Vec<String> {
    let text = fs::read_to_string(path).unwrap();
    let mut names: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("void "))
        .filter_map(|l| {
            let name = l["void ".len()..].split('(').next()?.trim();
            (name.starts_with("ggml_vec_dot_") || name.starts_with("quantize_row_")).then(|| name.to_string())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}
