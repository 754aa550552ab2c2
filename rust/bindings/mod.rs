//! PyO3 bindings (the `python` feature): argument and result translation
//! only. Only this folder names itself; the core never names it.

mod python;
mod python_cpu_attention;
mod python_cuda;
mod python_grammar;
mod python_native_step;
mod python_plan;
mod python_quant;
