/* A fake libcuda.so.1 for the GPU stage's CUDA check (tests/fakes.py builds
 * it beside the fake NVML). Built with -DFAKE_CUDA_WITH_HEADER against
 * NVIDIA's cuda.h (the nvidia-cuda-runtime-cu12 wheel's
 * nvidia/cuda_runtime/include/cuda.h) the compiler checks these signatures.
 *
 * The scenario is read with getenv() at call time:
 *   FAKE_CUDA_INIT   what cuInit returns: a CUresult number (default 0), or
 *                    "block" to hang as a wedged driver does
 *   FAKE_CUDA_COUNT  what cuDeviceGetCount reports (default FAKE_NVML_COUNT,
 *                    else 1: the fake NVML's count); with CUDA_VISIBLE_DEVICES
 *                    set, its number of entries, as the real driver counts
 *                    only the devices it names (CUDA C Programming Guide,
 *                    "CUDA Environment Variables")
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef FAKE_CUDA_WITH_HEADER
#include <cuda.h>
#else
typedef int CUresult;
#define CUDAAPI
#endif

static const char *setting(const char *name, const char *fallback)
{
    const char *value = getenv(name);
    return value && *value ? value : fallback;
}

CUresult CUDAAPI cuInit(unsigned int Flags)
{
    const char *mode = setting("FAKE_CUDA_INIT", "0");
    (void)Flags;
    while (strcmp(mode, "block") == 0)
        pause();
    return (CUresult)atoi(mode);
}

CUresult CUDAAPI cuDeviceGetCount(int *count)
{
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    *count = atoi(setting("FAKE_CUDA_COUNT", setting("FAKE_NVML_COUNT", "1")));
    if (visible) {
        *count = *visible != '\0';
        for (; *visible; visible++)
            *count += *visible == ',';
    }
    return (CUresult)0;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr)
{
    /* The driver's words for the codes the tests use (cuda.h, doc comments
     * of CUDA_ERROR_SYSTEM_NOT_READY and CUDA_ERROR_UNKNOWN). */
    switch ((int)error) {
    case 802: *pStr = "system not yet initialized"; break;
    case 999: *pStr = "unknown error"; break;
    default: *pStr = "fake CUDA error"; break;
    }
    return (CUresult)0;
}
