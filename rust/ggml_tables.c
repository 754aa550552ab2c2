// The lookup tables ggml-cpu's kernels read (defined in ggml-cpu.c, which
// guided does not build: it is ggml's graph executor, and guided calls the
// kernels directly). Filled once by guided_ggml_init, as ggml_cpu_init does.
#include <stdint.h>

#include "ggml.h"
#include "ggml-impl.h"

float ggml_table_f32_f16[1 << 16];
float ggml_table_f32_e8m0_half[1 << 8];
float ggml_table_f32_ue4m3[1 << 8];

void guided_ggml_init(void) {
    for (int i = 0; i < (1 << 16); ++i) {
        ggml_table_f32_f16[i] = ggml_fp16_to_fp32((ggml_fp16_t) i);
    }
    for (int i = 0; i < (1 << 8); ++i) {
        ggml_table_f32_e8m0_half[i] = ggml_e8m0_to_fp32_half((uint8_t) i);
        ggml_table_f32_ue4m3[i] = ggml_ue4m3_to_fp32((uint8_t) i);
    }
}
