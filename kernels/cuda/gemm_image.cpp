// The fatbin of kernels/cuda/gemm_kernels.cu that nvcc built (CMakeLists.txt), embedded in libember's
// read-only data: kernels/cuda/gemm.cpp hands it to cuModuleLoadData.
#ifndef EMBER_GEMM_FATBIN
#error "EMBER_GEMM_FATBIN (the fatbin's path) is set by CMakeLists.txt"
#endif

// A fatbin must start 8-byte aligned; 16 is what the driver documents for images.
__asm__(".pushsection .rodata\n"
        ".globl ember_gemm_fatbin_start\n"
        ".hidden ember_gemm_fatbin_start\n"
        ".balign 16\n"
        "ember_gemm_fatbin_start:\n"
        ".incbin \"" EMBER_GEMM_FATBIN "\"\n"
        ".popsection\n");

namespace ember::cuda {

extern "C" const unsigned char ember_gemm_fatbin_start[];

const void* gemm_kernels_image() { return ember_gemm_fatbin_start; }

}  // namespace ember::cuda
