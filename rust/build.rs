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
