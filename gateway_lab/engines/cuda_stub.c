/* A stand-in libcuda.so.1 for machines without an NVIDIA driver.
 *
 * CUDA builds of torch and of SGLang's kernel package link against the driver library and resolve a few of its
 * entry points when they load; without the library the import fails before SGLang's CPU path is ever reached.
 * Every function here answers CUDA_ERROR_NO_DEVICE (100), so the CUDA runtime reports zero devices and the
 * engine runs on the CPU (docs/engines.md). Built by `gateway engines install` with `cc -shared -fPIC`. */
typedef int CUresult;
enum { CUDA_ERROR_NO_DEVICE = 100 };

CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDriverGetVersion(int *version) { if (version) *version = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, void *status) {
    (void)symbol; (void)version; (void)flags; (void)status;
    if (pfn) *pfn = 0;
    return CUDA_ERROR_NO_DEVICE;
}
CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)data; (void)attribute; (void)ptr;
    return CUDA_ERROR_NO_DEVICE;
}
