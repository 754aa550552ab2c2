//! Builds ggml's quantized CPU kernels from ggml's own sources.
//!
//! The sources are those `make setup` unpacks from llama-cpp-python's sdist on
//! PyPI into `.ggml/` (or wherever `GGML_SRC` points: a ggml directory with
//! `include/` and `src/`). Two pieces are compiled:
//!
//! * ggml-base at the baseline ISA: the row formats, `dequantize_row_*` and
//!   the reference quantizers (`ggml-quants.c`) with what they link against.
//! * ggml-cpu's x86 dot products and activation quantizers
//!   (`ggml-cpu/arch/x86/quants.c`) once per ISA level, each copy's public
//!   names prefixed with its level (`guided_avx2_ggml_vec_dot_q4_1_q8_1`).
//!   The Rust side (`rust/quant.rs`) picks the best level the CPU has at run
//!   time, so one build runs on AVX2-only and AVX-512 machines alike.
//!
//! With the `cuda` feature it also compiles the kernels in `cuda/` with nvcc
//! into one fatbin (machine code for sm_80 and sm_90, and sm_90 PTX that
//! newer GPUs compile at load), which `rust/cuda.rs` embeds. nvcc comes from
//! PyPI (`nvidia-cuda-nvcc`, installed in the venv by `make setup`); it is
//! found through `GUIDED_NVCC`, the active venv, or PATH.

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
    println!("cargo:rerun-if-env-changed=GGML_SRC");
    println!("cargo:rerun-if-changed=rust/ggml_tables.c");
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let src = env::var_os("GGML_SRC").map(PathBuf::from).unwrap_or_else(|| root.join(".ggml/ggml"));
    if !src.join("src").join(KERNELS).exists() {
        panic!(
            "ggml's sources are not at {} (set GGML_SRC to a ggml directory, or run `make setup`, \
             which unpacks them from llama-cpp-python's sdist on PyPI)",
            src.display()
        );
    }
    println!("cargo:rerun-if-changed={}", src.display());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
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
    let nvcc = find_nvcc().unwrap_or_else(|| {
        panic!(
            "the cuda feature needs nvcc: install it with `pip install nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt` \
             into the active venv (make setup does), set GUIDED_NVCC to an nvcc, or build without the feature"
        )
    });
    let mut sources: Vec<PathBuf> = fs::read_dir(root.join("cuda"))
        .expect("cuda/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    // one fatbin per file, then one embedded blob per file (rust/cuda.rs)
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
    if let Some(p) = env::var_os("GUIDED_NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Some(venv) = env::var_os("VIRTUAL_ENV") {
        let lib = Path::new(&venv).join("lib");
        for entry in fs::read_dir(lib).ok()?.flatten() {
            let nvcc = entry.path().join("site-packages/nvidia/cu13/bin/nvcc");
            if nvcc.exists() {
                return Some(nvcc);
            }
        }
    }
    env::var_os("PATH").and_then(|paths| env::split_paths(&paths).map(|d| d.join("nvcc")).find(|p| p.exists()))
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
