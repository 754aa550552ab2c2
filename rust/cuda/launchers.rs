//! Launches the kernels of `cuda/` (compiled into fatbins by rust/build.rs
//! and embedded here) through the CUDA driver API, which cudarc loads at run
//! time: the module builds and imports where there is no CUDA, and
//! [`available`] says why not.
//!
//! Every call takes raw device pointers and the stream to launch on (torch's
//! current stream, handed over by python/guided/cuda_ops.py), so nothing is
//! copied to the host and the kernels run in order with torch's own work.
//! The kernels are loaded once per CUDA context (torch's primary context),
//! on first use. Sizes are checked before any launch
//! ([`crate::cuda::reference`] says what a valid call is).

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;

use crate::cuda::reference::{DecodeScores, DecodeShape, SamplePointers, WARPS};

/// (file stem, fatbin) for each `cuda/*.cu`.
static FATBINS: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/cuda_fatbins.rs"));

/// The element types the kernels are built for, by torch's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    pub fn parse(name: &str) -> Result<Dtype, String> {
        match name {
            "torch.float32" | "float32" => Ok(Dtype::F32),
            "torch.float16" | "float16" => Ok(Dtype::F16),
            "torch.bfloat16" | "bfloat16" => Ok(Dtype::Bf16),
            other => Err(format!("dtype {other} is not one the kernels are built for (float32, float16, bfloat16)")),
        }
    }
}

fn check(result: sys::CUresult, what: &str) -> Result<(), String> {
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver writes a pointer to a static string or leaves null
    unsafe { sys::cuGetErrorString(result, &mut text) };
    let name = if text.is_null() { format!("{result:?}") } else { unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned() };
    Err(format!("{what}: {name}"))
}

/// Ok when a CUDA driver is present and sees a device; else why not.
/// Probed once per process (every launch asks).
pub fn available() -> Result<(), String> {
    static PROBED: OnceLock<Result<(), String>> = OnceLock::new();
    PROBED.get_or_init(probe).clone()
}

fn probe() -> Result<(), String> {
    if let Some(why) = option_env!("GUIDED_NO_CUDA_KERNELS") {
        return Err(why.to_string());
    }
    // SAFETY: only probes for the library; nothing is called if it is absent
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda) on this machine".into());
    }
    let mut count = 0;
    // SAFETY: plain driver calls with valid out-pointers
    unsafe {
        check(sys::cuInit(0), "cuInit")?;
        check(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
    }
    if count == 0 {
        return Err("the CUDA driver sees no device".into());
    }
    Ok(())
}

/// Loaded functions by (context, name). Raw driver handles are plain
/// addresses here; the driver keeps them valid while the context lives.
static FUNCTIONS: Mutex<Option<HashMap<(usize, &'static str), usize>>> = Mutex::new(None);
static MODULES: Mutex<Option<HashMap<usize, Vec<usize>>>> = Mutex::new(None);

fn function(name: &'static str) -> Result<sys::CUfunction, String> {
    available()?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: out-pointer to a local
    unsafe { check(sys::cuCtxGetCurrent(&mut ctx), "cuCtxGetCurrent")? };
    if ctx.is_null() {
        return Err("no current CUDA context on this thread (torch makes one when it first uses the device)".into());
    }
    let key = (ctx as usize, name);
    let mut functions = FUNCTIONS.lock().unwrap();
    if let Some(&f) = functions.get_or_insert_with(HashMap::new).get(&key) {
        return Ok(f as sys::CUfunction);
    }
    let mut modules = MODULES.lock().unwrap();
    let loaded = modules.get_or_insert_with(HashMap::new).entry(ctx as usize).or_default();
    if loaded.is_empty() {
        for (stem, image) in FATBINS {
            // the driver wants the image aligned; include_bytes! promises no alignment
            let mut aligned = vec![0u64; image.len().div_ceil(8)];
            // SAFETY: the buffer holds at least image.len() bytes
            unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), aligned.as_mut_ptr().cast::<u8>(), image.len()) };
            let mut module: sys::CUmodule = std::ptr::null_mut();
            // SAFETY: a complete fatbin image, alive for the call
            unsafe { check(sys::cuModuleLoadData(&mut module, aligned.as_ptr().cast()), &format!("loading cuda/{stem}.cu"))? };
            loaded.push(module as usize);
        }
    }
    let cname = std::ffi::CString::new(name).unwrap();
    for &module in loaded.iter() {
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name
        if unsafe { sys::cuModuleGetFunction(&mut f, module as sys::CUmodule, cname.as_ptr()) } == sys::CUresult::CUDA_SUCCESS {
            functions.as_mut().unwrap().insert(key, f as usize);
            return Ok(f);
        }
    }
    Err(format!("kernel {name} is not in the embedded fatbins"))
}

/// Launch `name` with `args` (each a pointer to one argument's value, in
/// the kernel's order) on `stream`.
///
/// # Safety
/// `args` must match the kernel's parameters and every device pointer in
/// them must be valid for what the kernel reads and writes.
unsafe fn launch(name: &'static str, grid: (u32, u32), block: u32, stream: u64, args: &mut [*mut c_void]) -> Result<(), String> {
    let f = function(name)?;
    check(
        sys::cuLaunchKernel(f, grid.0, grid.1, 1, block, 1, 1, 0, stream as sys::CUstream, args.as_mut_ptr(), std::ptr::null_mut()),
        name,
    )
}

macro_rules! arg {
    ($v:expr) => {
        (&$v as *const _ as *mut c_void)
    };
}

fn decode_name(dtype: Dtype, head: usize) -> &'static str {
    match (dtype, head) {
        (Dtype::F32, 64) => "guided_paged_decode_f32_h64",
        (Dtype::F32, 128) => "guided_paged_decode_f32_h128",
        (Dtype::F32, _) => "guided_paged_decode_f32_h256",
        (Dtype::F16, 64) => "guided_paged_decode_f16_h64",
        (Dtype::F16, 128) => "guided_paged_decode_f16_h128",
        (Dtype::F16, _) => "guided_paged_decode_f16_h256",
        (Dtype::Bf16, 64) => "guided_paged_decode_bf16_h64",
        (Dtype::Bf16, 128) => "guided_paged_decode_bf16_h128",
        (Dtype::Bf16, _) => "guided_paged_decode_bf16_h256",
    }
}

/// Decode attention (cuda/paged_attention.cu). Pointers: q [seqs, heads,
/// head], caches [blocks, block_size, kv_heads, head], block_tables [seqs,
/// max_blocks] int32, context_lens [seqs] int32, out like q; the sinks
/// (float32 [heads]) by pointer too.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode(
    shape: &DecodeShape,
    dtype: Dtype,
    q: u64,
    k_cache: u64,
    v_cache: u64,
    block_tables: u64,
    context_lens: u64,
    out: u64,
    scores: &DecodeScores<u64>,
    stream: u64,
) -> Result<(), String> {
    shape.check()?;
    scores.check()?;
    if shape.seqs == 0 {
        return Ok(());
    }
    let ints = |v: usize| i32::try_from(v).map_err(|_| format!("{v} does not fit a 32-bit int"));
    let (heads, kv_heads, block_size, max_blocks) =
        (ints(shape.heads)?, ints(shape.kv_heads)?, ints(shape.block_size)?, ints(shape.max_blocks)?);
    let (scale, window, softcap, sinks) = (scores.scale, ints(scores.window)?, scores.softcap, scores.sinks.unwrap_or(0));
    let mut args = [
        arg!(q), arg!(k_cache), arg!(v_cache), arg!(block_tables), arg!(context_lens), arg!(out),
        arg!(heads), arg!(kv_heads), arg!(block_size), arg!(max_blocks), arg!(scale),
        arg!(window), arg!(softcap), arg!(sinks),
    ];
    // SAFETY: the arguments are the kernel's, in order; the caller vouches for the pointers
    unsafe { launch(decode_name(dtype, shape.head_size), (shape.heads as u32, shape.seqs as u32), (WARPS * 32) as u32, stream, &mut args) }
}

/// New K/V rows ([tokens, row_elems]) into their cache slots (int64 [tokens]).
#[allow(clippy::too_many_arguments)]
pub fn write_kv(dtype: Dtype, tokens: usize, row_elems: usize, k: u64, v: u64, k_cache: u64, v_cache: u64, slots: u64, stream: u64) -> Result<(), String> {
    if tokens == 0 {
        return Ok(());
    }
    let row = i32::try_from(row_elems).map_err(|_| "a KV row is too long".to_string())?;
    let name = match dtype {
        Dtype::F32 => "guided_write_kv_f32",
        Dtype::F16 => "guided_write_kv_f16",
        Dtype::Bf16 => "guided_write_kv_bf16",
    };
    let mut args = [arg!(k), arg!(v), arg!(k_cache), arg!(v_cache), arg!(slots), arg!(row)];
    // SAFETY: as above
    unsafe { launch(name, (tokens as u32, 1), row_elems.min(256) as u32, stream, &mut args) }
}

/// Mask-fused sampling (cuda/sampling.cu), one CTA per row. The per-row
/// values live on the device: check them first with
/// [`crate::cuda::reference::check_sample`].
pub fn masked_sample(rows: usize, vocab: usize, words: usize, p: SamplePointers, stream: u64) -> Result<(), String> {
    if rows == 0 {
        return Ok(());
    }
    let (vocab, words) = (i32::try_from(vocab).map_err(|e| e.to_string())?, i32::try_from(words).map_err(|e| e.to_string())?);
    let mut args = [
        arg!(p.logits), arg!(p.mask), arg!(vocab), arg!(words), arg!(p.temperature), arg!(p.top_k), arg!(p.top_p),
        arg!(p.min_p), arg!(p.seeds), arg!(p.steps), arg!(p.tokens), arg!(p.logprobs),
    ];
    // SAFETY: as above
    unsafe { launch("guided_masked_sample", (rows as u32, 1), 1024, stream, &mut args) }
}

/// Penalties, bias and bans for `entries` distinct (row, token) pairs, in
/// place on the logits (cuda/sampling.cu `guided_adjust_logits`).
#[allow(clippy::too_many_arguments)]
pub fn adjust_logits(
    logits: u64,
    vocab: usize,
    entries: usize,
    rows: u64,
    tokens: u64,
    seen: u64,
    counts: u64,
    bias: u64,
    penalties: [u64; 3],
    stream: u64,
) -> Result<(), String> {
    if entries == 0 {
        return Ok(());
    }
    let (vocab, n) = (i32::try_from(vocab).map_err(|e| e.to_string())?, i32::try_from(entries).map_err(|e| e.to_string())?);
    let [repetition, frequency, presence] = penalties;
    let mut args = [
        arg!(logits), arg!(vocab), arg!(n), arg!(rows), arg!(tokens), arg!(seen), arg!(counts), arg!(bias),
        arg!(repetition), arg!(frequency), arg!(presence),
    ];
    // SAFETY: as above
    unsafe { launch("guided_adjust_logits", (entries.div_ceil(256) as u32, 1), 256, stream, &mut args) }
}

/// The kernels the fatbins hold, by file (for `guided._native.cuda_kernels`).
pub fn kernel_files() -> Vec<(&'static str, usize)> {
    FATBINS.iter().map(|(stem, image)| (*stem, image.len())).collect()
}
