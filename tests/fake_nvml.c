/*
 * A fake libnvidia-ml.so.1 for the gpu_preflight tests (no GPU needed).
 *
 *   cc -shared -fPIC -O1 -Wall -o DIR/libnvidia-ml.so.1 tests/fake_nvml.c
 *   cc ... -DFAKE_OLD_DRIVER ...   a pre-R510 driver: no
 *          nvmlDeviceGetMemoryInfo_v2, nvmlDeviceGetComputeRunningProcesses_v3
 *          or _v2, nor nvmlDeviceGetGpuFabricInfoV (ctypes then raises
 *          AttributeError on lookup); field 230 (the recovery action, R570
 *          on) answers NOT_SUPPORTED
 *
 * Signatures, struct layouts and error codes are nvml.h's: built plain it
 * declares what it needs itself (below); tests/test_nvml_header.py builds it
 * with -DFAKE_NVML_WITH_HEADER against NVIDIA's nvml.h (the nvidia-nvml-dev
 * wheel), where the compiler holds each function against NVIDIA's
 * declaration. tests/fakes.py builds it (build_fake_nvml).
 *
 * The scenario is read with getenv() at call time, so one build serves every
 * test:
 *   FAKE_NVML_MODE   free (default) | busy | lost | noperm | nodriver |
 *                    mismatch | stub | unsupported | mig | remap | retired |
 *                    ecc | hang | hang_device
 *   FAKE_NVML_COUNT  number of GPUs, 0..8 (default 1)
 *   FAKE_NVML_BUSY   comma list of busy indexes ("0,2"), in the modes whose
 *                    GPUs are otherwise free (free, lost, remap, retired,
 *                    hang_device)
 *   FAKE_NVML_LOST_INDEX  the GPU that lost/remap/retired act on (default:
 *                    the last one)
 *   FAKE_NVML_RECOVERY_ACTION  the recovery action (nvmlDeviceGetFieldValues,
 *                    field 230) of the target GPU (FAKE_NVML_LOST_INDEX);
 *                    the others report 0, NONE
 *   FAKE_NVML_FABRIC  unset: nvmlDeviceGetGpuFabricInfoV is NOT_SUPPORTED
 *                    (a GPU without NVSwitch); "STATE" or "STATE:STATUS":
 *                    the target GPU's fabric state and status, the others
 *                    COMPLETED with NVML_SUCCESS
 *   FAKE_NVML_FABRIC_V2_ONLY  when set, the fabric call refuses v3's version
 *                    with ARGUMENT_VERSION_MISMATCH (a driver that knows v2)
 *   FAKE_NVML_LOG    append one line per call (the symbol name; for
 *                    nvmlDeviceGetMemoryInfo_v2 also " version=0x%08x")
 *   FAKE_NVML_RUNNERS  a file of "PID BYTES" lines, read at every call:
 *                    compute processes on GPU 0 (at most 4) in every mode
 *                    with processes, their bytes added to its used memory
 *                    (tests/ollama_emu.py writes it: the model runners it
 *                    has on the GPU)
 * A program that clears the environment (slurmd runs HealthCheckProgram with
 * SLURMD_NODENAME alone) cannot pass FAKE_NVML_MODE: build with
 * -DFAKE_NVML_DEFAULT_MODE='"nodriver"' for a library whose mode, when the
 * variable is unset or empty, is that one instead of free; likewise
 * -DFAKE_NVML_DEFAULT_RUNNERS='"/run/fake-gpu-runners"'.
 *
 * Figures: every GPU is an "NVIDIA H200", 143771 MiB total, 542 MiB
 * reserved; UUID of GPU i is GPU-<8 x hex digit 10+i>-5e1f-4c2d-9a7b-
 * 0123456789ab; its PCI bus id 00000000:6<i+1>:00.0, the fake nvidia-smi's
 * pci.bus_id (tests/fakes.py pci_bus_id). v2 memory: free GPU used 0, busy
 * 102400 MiB, MIG parent 20480 MiB; free = total - reserved - used. The v1
 * call reports the older accounting on purpose: used = v2 used + reserved +
 * 1024 MiB, free = v2 free - 1024 MiB. Utilisation 0/0 free, 97/60 busy.
 * Temperature 29 free, 83 busy, 40 MIG. A busy GPU runs pid 4242 (102400
 * MiB); a MIG parent runs pid 4343 (20480 MiB, on MIG slot 0).
 *
 * MIG mode: slots 0 and 1 hold MIG devices (UUID MIG-<8 x parent digit>-
 * 0000-4000-8000-00000000000<slot>, name "NVIDIA H200 MIG 3g.71gb", 71680 MiB
 * total, 0 reserved, slot 0 used 20480 MiB with pid 4343, slot 1 idle);
 * slots 2..6 are empty (NOT_FOUND). On a MIG device handle utilisation,
 * temperature, remapped rows, retired pages and MIG mode return NOT_SUPPORTED;
 * GetMaxMigDeviceCount and GetMigDeviceHandleByIndex return INVALID_ARGUMENT.
 */

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef FAKE_NVML_WITH_HEADER
/* tests/test_nvml_header.py builds with -DFAKE_NVML_WITH_HEADER and NVIDIA's
 * nvml.h on the include path, so that the compiler holds every function
 * below against NVIDIA's declaration of it. NVML_NO_UNVERSIONED_FUNC_DEFS
 * keeps the unversioned names what they are in the library, the old-ABI
 * symbols (without it nvml.h #defines nvmlDeviceGetComputeRunningProcesses
 * to its _v3, nvmlInit to nvmlInit_v2 and so on) and makes nvml.h declare
 * them. */
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>
#else
/* Without the header: the few declarations this file needs, as nvml.h has
 * them (names, values, field order). */
typedef enum nvmlReturn_enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef struct nvmlDevice_st *nvmlDevice_t;     /* opaque */

typedef enum nvmlEnableState_enum {
    NVML_FEATURE_DISABLED = 0,
    NVML_FEATURE_ENABLED = 1
} nvmlEnableState_t;

typedef enum nvmlTemperatureSensors_enum {
    NVML_TEMPERATURE_GPU = 0,
    NVML_TEMPERATURE_GPU_MAX = 1,
    NVML_TEMPERATURE_COUNT
} nvmlTemperatureSensors_t;

typedef enum nvmlMemoryErrorType_enum {
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1,
    NVML_MEMORY_ERROR_TYPE_COUNT
} nvmlMemoryErrorType_t;

typedef enum nvmlEccCounterType_enum {
    NVML_VOLATILE_ECC = 0,
    NVML_AGGREGATE_ECC = 1,
    NVML_ECC_COUNTER_TYPE_COUNT
} nvmlEccCounterType_t;

/* 24 bytes, order total, free, used */
typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

/* 40 bytes (4 bytes of padding after version) */
typedef struct nvmlMemory_v2_st {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

/* NVML_STRUCT_VERSION(Memory, 2) */
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2 << 24U)))

/* 8 bytes */
typedef struct nvmlUtilization_st {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* 16 bytes */
typedef struct nvmlProcessInfo_v1_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* 24 bytes; what _v3 (as nvmlProcessInfo_t) and _v2 take */
typedef struct nvmlProcessInfo_v2_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t, nvmlProcessInfo_t;

/* the one value type the fake writes (an enum: an int, as nvml.h's) */
typedef enum nvmlValueType_enum {
    NVML_VALUE_TYPE_UNSIGNED_INT = 1
} nvmlValueType_t;

/* 8 bytes */
typedef union nvmlValue_st {
    double dVal;
    int siVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    unsigned short usVal;
} nvmlValue_t;

/* 40 bytes */
typedef struct nvmlFieldValue_st {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    nvmlValueType_t valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230

typedef unsigned char nvmlGpuFabricState_t;

/* 40 bytes; v2 is the same without healthSummary (36 bytes) */
typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    nvmlGpuFabricState_t state;
    unsigned int healthMask;
    unsigned char healthSummary;
} nvmlGpuFabricInfo_v3_t;

typedef nvmlGpuFabricInfo_v3_t nvmlGpuFabricInfoV_t;

/* NVML_STRUCT_VERSION(GpuFabricInfo, 3) and (GpuFabricInfo, 2) */
#define nvmlGpuFabricInfo_v3 ((unsigned int)(sizeof(nvmlGpuFabricInfo_v3_t) | (3 << 24U)))
#define nvmlGpuFabricInfo_v2 ((unsigned int)(36 | (2 << 24U)))
#define NVML_GPU_FABRIC_STATE_NOT_SUPPORTED 0
#define NVML_GPU_FABRIC_STATE_COMPLETED 3

/* 68 bytes; busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE], busId[NVML_
 * DEVICE_PCI_BUS_ID_BUFFER_SIZE] */
typedef struct nvmlPciInfo_st {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
#endif /* FAKE_NVML_WITH_HEADER */

#define MIB 1048576ULL
#define MAX_GPUS 8
#define MIG_SLOTS 7
#define MIG_USED_SLOTS 2
#define TOTAL_MIB 143771ULL
#define RESERVED_MIB 542ULL
#define BUSY_MIB 102400ULL
#define MIG_PARENT_MIB 20480ULL
#define MIG_TOTAL_MIB 71680ULL
#define V1_EXTRA_MIB 1024ULL
#define NO_ID 0xFFFFFFFFu

/* One record per parent GPU and per MIG slot. Handles point into this
 * single array: parents at [0, MAX_GPUS), then MIG_SLOTS per parent. */
struct dev {
    int index;      /* parent index */
    int slot;       /* -1 for a parent, else MIG slot */
};

#define NDEVS (MAX_GPUS + MAX_GPUS * MIG_SLOTS)
static struct dev devs[NDEVS];
static int devs_ready;
static int init_refs;

static const char *hexdigits = "abcdef";

enum mode {
    M_FREE, M_BUSY, M_LOST, M_NOPERM, M_NODRIVER, M_MISMATCH, M_STUB,
    M_UNSUPPORTED, M_MIG, M_REMAP, M_RETIRED, M_HANG, M_HANG_DEVICE, M_ECC
};

/* ---- scenario ------------------------------------------------------- */

#ifndef FAKE_NVML_DEFAULT_MODE
#define FAKE_NVML_DEFAULT_MODE "free"
#endif
#ifndef FAKE_NVML_DEFAULT_RUNNERS
#define FAKE_NVML_DEFAULT_RUNNERS ""
#endif

static enum mode get_mode(void)
{
    static const struct { const char *name; enum mode mode; } table[] = {
        {"free", M_FREE}, {"busy", M_BUSY}, {"lost", M_LOST},
        {"noperm", M_NOPERM}, {"nodriver", M_NODRIVER},
        {"mismatch", M_MISMATCH}, {"stub", M_STUB},
        {"unsupported", M_UNSUPPORTED}, {"mig", M_MIG}, {"remap", M_REMAP},
        {"retired", M_RETIRED}, {"hang", M_HANG},
        {"hang_device", M_HANG_DEVICE}, {"ecc", M_ECC},
    };
    const char *value = getenv("FAKE_NVML_MODE");
    size_t i;

    if (value == NULL || *value == '\0')
        value = FAKE_NVML_DEFAULT_MODE;
    for (i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(value, table[i].name) == 0)
            return table[i].mode;
    return M_FREE;
}

/* A non-negative decimal from the environment, else fallback. */
static int env_int(const char *name, int fallback)
{
    const char *value = getenv(name);
    char *end;
    long n;

    if (value == NULL || *value == '\0')
        return fallback;
    n = strtol(value, &end, 10);
    if (*end != '\0' || n < 0 || n > 1000000)
        return fallback;
    return (int)n;
}

static int gpu_count(void)
{
    int n = env_int("FAKE_NVML_COUNT", 1);
    return n > MAX_GPUS ? MAX_GPUS : n;
}

/* The GPU that lost/remap/retired act on: FAKE_NVML_LOST_INDEX, else last. */
static int target_index(void)
{
    return env_int("FAKE_NVML_LOST_INDEX", gpu_count() - 1);
}

/* Is index listed in FAKE_NVML_BUSY ("0,2")? */
static int listed_busy(int index)
{
    const char *p = getenv("FAKE_NVML_BUSY");
    char *end;
    long n;

    if (p == NULL)
        return 0;
    while (*p != '\0') {
        while (*p == ',' || *p == ' ')
            p++;
        if (*p == '\0')
            break;
        n = strtol(p, &end, 10);
        if (end == p)
            return 0;
        if (n == index)
            return 1;
        p = end;
    }
    return 0;
}

enum state { S_FREE, S_BUSY, S_MIG };

static enum state gpu_state(enum mode mode, int index)
{
    switch (mode) {
    case M_BUSY:
        return S_BUSY;
    case M_MIG:
        return S_MIG;
    case M_FREE: case M_LOST: case M_REMAP: case M_RETIRED:
    case M_HANG_DEVICE: case M_ECC:
        return listed_busy(index) ? S_BUSY : S_FREE;
    default:
        return S_FREE;
    }
}

/* ---- logging -------------------------------------------------------- */

static void log_call(const char *symbol, const char *extra)
{
    const char *path = getenv("FAKE_NVML_LOG");
    char line[160];
    int fd, len;

    if (path == NULL || *path == '\0')
        return;
    len = snprintf(line, sizeof line, "%s%s\n", symbol, extra ? extra : "");
    if (len < 0 || (size_t)len >= sizeof line)
        return;
    fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    if (write(fd, line, (size_t)len) != len) {
        /* nothing to do: logging is best effort */
    }
    close(fd);
}

#define LOG() log_call(__func__, NULL)

/* ---- handles -------------------------------------------------------- */

static void setup_devs(void)
{
    int i, s;

    if (devs_ready)
        return;
    for (i = 0; i < MAX_GPUS; i++) {
        devs[i].index = i;
        devs[i].slot = -1;
        for (s = 0; s < MIG_SLOTS; s++) {
            devs[MAX_GPUS + i * MIG_SLOTS + s].index = i;
            devs[MAX_GPUS + i * MIG_SLOTS + s].slot = s;
        }
    }
    devs_ready = 1;
}

/* The handle of a record (nvmlDevice_t is an opaque pointer). */
static nvmlDevice_t handle_of(struct dev *d)
{
    return (nvmlDevice_t)(void *)d;
}

/* The record behind a handle handed out now, else NULL. Compares for
 * equality against every record, so a truncated or made-up pointer is
 * never dereferenced. */
static struct dev *lookup(nvmlDevice_t handle)
{
    int i, count = gpu_count();

    for (i = 0; i < NDEVS; i++) {
        if (handle != handle_of(&devs[i]))
            continue;
        if (devs[i].index >= count)
            return NULL;
        if (devs[i].slot >= 0 &&
            (get_mode() != M_MIG || devs[i].slot >= MIG_USED_SLOTS))
            return NULL;
        return &devs[i];
    }
    return NULL;
}

/* Common entry checks for a function taking a handle. */
#define DEVICE_ENTRY(handle, d)                                     \
    struct dev *d;                                                  \
    LOG();                                                          \
    if (init_refs <= 0)                                             \
        return NVML_ERROR_UNINITIALIZED;                            \
    if ((d = lookup(handle)) == NULL)                               \
        return NVML_ERROR_INVALID_ARGUMENT

static nvmlReturn_t copy_string(const char *text, char *buf,
                                unsigned int length)
{
    size_t need = strlen(text) + 1;

    if (buf == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (length < need)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, text, need);
    return NVML_SUCCESS;
}

/* ---- library -------------------------------------------------------- */

static const char stub_banner[] =
    "WARNING:\n\n"
    "You should always run with libnvidia-ml.so that is installed with your\n"
    "NVIDIA Display Driver. By default it's installed in /usr/lib and /usr/lib64.\n"
    "libnvidia-ml.so in GDK package is a stub library that is attached only for\n"
    "build purposes (e.g. machine that you build your application doesn't have\n"
    "to have Display Driver installed).\n";

nvmlReturn_t nvmlInit_v2(void)
{
    LOG();
    setup_devs();
    switch (get_mode()) {
    case M_NODRIVER:
        return NVML_ERROR_DRIVER_NOT_LOADED;
    case M_MISMATCH:
        return NVML_ERROR_LIB_RM_VERSION_MISMATCH;
    case M_STUB:
        if (write(1, stub_banner, sizeof stub_banner - 1) < 0) {
            /* stdout closed: the stub fails all the same */
        }
        return NVML_ERROR_UNKNOWN;
    case M_HANG:
        for (;;)
            pause();
    default:
        break;
    }
    init_refs++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void)
{
    LOG();
    if (init_refs <= 0)
        return NVML_ERROR_UNINITIALIZED;
    init_refs--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    LOG();
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    LOG();
    if (init_refs <= 0)
        return NVML_ERROR_UNINITIALIZED;
    return copy_string("550.127.05", version, length);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    LOG();
    if (init_refs <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if (deviceCount == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = (unsigned int)gpu_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index,
                                           nvmlDevice_t *device)
{
    enum mode mode;

    LOG();
    if (init_refs <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= (unsigned int)gpu_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    mode = get_mode();
    if (mode == M_NOPERM)
        return NVML_ERROR_NO_PERMISSION;
    if (mode == M_LOST && (int)index == target_index())
        return NVML_ERROR_GPU_IS_LOST;
    *device = handle_of(&devs[index]);
    return NVML_SUCCESS;
}

/* ---- identity ------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid,
                               unsigned int length)
{
    char text[96];
    char digit;
    DEVICE_ENTRY(device, d);

    digit = hexdigits[d->index];
    if (d->slot < 0)
        snprintf(text, sizeof text,
                 "GPU-%c%c%c%c%c%c%c%c-5e1f-4c2d-9a7b-0123456789ab",
                 digit, digit, digit, digit, digit, digit, digit, digit);
    else
        snprintf(text, sizeof text,
                 "MIG-%c%c%c%c%c%c%c%c-0000-4000-8000-00000000000%d",
                 digit, digit, digit, digit, digit, digit, digit, digit,
                 d->slot);
    return copy_string(text, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name,
                               unsigned int length)
{
    DEVICE_ENTRY(device, d);
    return copy_string(d->slot < 0 ? "NVIDIA H200" : "NVIDIA H200 MIG 3g.71gb",
                       name, length);
}

/* ---- runners: processes another program puts on GPU 0 ---------------- */

#define MAX_RUNNERS 4

struct proc {
    unsigned int pid;
    unsigned long long used;
    unsigned int gi, ci;
};

/* The runners listed in FAKE_NVML_RUNNERS, if d is GPU 0: their count. */
static unsigned int runners_of(const struct dev *d, struct proc *p)
{
    const char *path = getenv("FAKE_NVML_RUNNERS");
    unsigned long long used;
    unsigned int pid, n = 0;
    FILE *file;

    if (path == NULL || *path == '\0')
        path = FAKE_NVML_DEFAULT_RUNNERS;
    if (d->index != 0 || d->slot >= 0 || *path == '\0' ||
        (file = fopen(path, "re")) == NULL)
        return 0;
    while (n < MAX_RUNNERS && fscanf(file, "%u %llu", &pid, &used) == 2) {
        p[n].pid = pid;
        p[n].used = used;
        p[n].gi = p[n].ci = NO_ID;
        n++;
    }
    fclose(file);
    return n;
}

/* ---- memory --------------------------------------------------------- */

/* Add the runners' bytes to *used. */
static void runners_used(const struct dev *d, unsigned long long *used)
{
    struct proc p[MAX_RUNNERS];
    unsigned int i, n = runners_of(d, p);

    for (i = 0; i < n; i++)
        *used += p[i].used;
}

static void memory_figures(const struct dev *d, unsigned long long *total,
                           unsigned long long *reserved,
                           unsigned long long *used)
{
    if (d->slot >= 0) {
        *total = MIG_TOTAL_MIB * MIB;
        *reserved = 0;
        *used = d->slot == 0 ? MIG_PARENT_MIB * MIB : 0;
        return;
    }
    *total = TOTAL_MIB * MIB;
    *reserved = RESERVED_MIB * MIB;
    switch (gpu_state(get_mode(), d->index)) {
    case S_BUSY: *used = BUSY_MIB * MIB; break;
    case S_MIG: *used = MIG_PARENT_MIB * MIB; break;
    default: *used = 0; break;
    }
    runners_used(d, used);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    unsigned long long total, reserved, used;
    DEVICE_ENTRY(device, d);

    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory_figures(d, &total, &reserved, &used);
    memory->total = total;
    memory->used = used + reserved + V1_EXTRA_MIB * MIB;
    memory->free = total - reserved - used - V1_EXTRA_MIB * MIB;
    return NVML_SUCCESS;
}

#ifndef FAKE_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device,
                                        nvmlMemory_v2_t *memory)
{
    char extra[32];
    unsigned long long total, reserved, used;
    struct dev *d;

    if (memory != NULL) {
        snprintf(extra, sizeof extra, " version=0x%08x", memory->version);
        log_call(__func__, extra);
    } else {
        log_call(__func__, NULL);
    }
    if (init_refs <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if ((d = lookup(device)) == NULL || memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory_figures(d, &total, &reserved, &used);
    memory->total = total;
    memory->reserved = reserved;
    memory->used = used;
    memory->free = total - reserved - used;
    return NVML_SUCCESS;
}
#endif

/* ---- utilisation and temperature ------------------------------------ */

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                           nvmlUtilization_t *utilization)
{
    enum mode mode;
    DEVICE_ENTRY(device, d);

    if (utilization == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    mode = get_mode();
    if (mode == M_HANG_DEVICE)
        for (;;)
            pause();
    if (mode == M_UNSUPPORTED || mode == M_MIG || d->slot >= 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (gpu_state(mode, d->index) == S_BUSY) {
        utilization->gpu = 97;
        utilization->memory = 60;
    } else {
        utilization->gpu = 0;
        utilization->memory = 0;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device,
                                      nvmlTemperatureSensors_t sensorType,
                                      unsigned int *temp)
{
    enum mode mode;
    DEVICE_ENTRY(device, d);

    if (temp == NULL || sensorType != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    mode = get_mode();
    if (mode == M_UNSUPPORTED || d->slot >= 0)
        return NVML_ERROR_NOT_SUPPORTED;
    switch (gpu_state(mode, d->index)) {
    case S_BUSY: *temp = 83; break;
    case S_MIG: *temp = 40; break;
    default: *temp = 29; break;
    }
    return NVML_SUCCESS;
}

/* ---- processes (two-call protocol) ---------------------------------- */

/* The processes on a device: the mode's 0 or 1, then the runners (p holds
 * 1 + MAX_RUNNERS). NOT_SUPPORTED or SUCCESS. */
static nvmlReturn_t processes_of(const struct dev *d, struct proc *p,
                                 unsigned int *n)
{
    enum mode mode = get_mode();

    *n = 0;
    if (mode == M_UNSUPPORTED)
        return NVML_ERROR_NOT_SUPPORTED;
    if (d->slot >= 0) {
        if (d->slot == 0) {
            p->pid = 4343;
            p->used = MIG_PARENT_MIB * MIB;
            p->gi = 1;
            p->ci = 0;
            *n = 1;
        }
        return NVML_SUCCESS;
    }
    switch (gpu_state(mode, d->index)) {
    case S_BUSY:
        p->pid = 4242;
        p->used = BUSY_MIB * MIB;
        p->gi = p->ci = NO_ID;
        *n = 1;
        break;
    case S_MIG:
        /* the parent aggregates its instances' processes (privileged) */
        p->pid = 4343;
        p->used = MIG_PARENT_MIB * MIB;
        p->gi = 1;
        p->ci = 0;
        *n = 1;
        break;
    default:
        break;
    }
    *n += runners_of(d, p + *n);
    return NVML_SUCCESS;
}

/* Shared by every version; exactly one of infos1 / infos2 is used. */
static nvmlReturn_t running_processes(nvmlDevice_t device,
                                      unsigned int *infoCount,
                                      nvmlProcessInfo_v1_t *infos1,
                                      nvmlProcessInfo_v2_t *infos2,
                                      int v1)
{
    struct proc p[1 + MAX_RUNNERS];
    unsigned int n, i;
    nvmlReturn_t ret;
    struct dev *d;

    if (init_refs <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if ((d = lookup(device)) == NULL || infoCount == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    ret = processes_of(d, p, &n);
    if (ret != NVML_SUCCESS)
        return ret;
    if (*infoCount < n) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n > 0 && (v1 ? (void *)infos1 : (void *)infos2) == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (i = 0; i < n; i++) {
        if (v1) {
            infos1[i].pid = p[i].pid;
            infos1[i].usedGpuMemory = p[i].used;
        } else {
            infos2[i].pid = p[i].pid;
            infos2[i].usedGpuMemory = p[i].used;
            infos2[i].gpuInstanceId = p[i].gi;
            infos2[i].computeInstanceId = p[i].ci;
        }
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

#ifndef FAKE_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(
    nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos)
{
    LOG();
    return running_processes(device, infoCount, NULL, infos, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(
    nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v2_t *infos)
{
    LOG();
    return running_processes(device, infoCount, NULL, infos, 0);
}
#endif

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(
    nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v1_t *infos)
{
    LOG();
    return running_processes(device, infoCount, infos, NULL, 1);
}

/* ---- MIG ------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                  unsigned int *pendingMode)
{
    unsigned int on;
    DEVICE_ENTRY(device, d);

    if (currentMode == NULL || pendingMode == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d->slot >= 0)
        return NVML_ERROR_NOT_SUPPORTED;
    on = get_mode() == M_MIG ? 1 : 0;
    *currentMode = on;
    *pendingMode = on;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device,
                                            unsigned int *count)
{
    DEVICE_ENTRY(device, d);

    if (count == NULL || d->slot >= 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = MIG_SLOTS;        /* the H200 supports MIG, enabled or not */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device,
                                                 unsigned int index,
                                                 nvmlDevice_t *migDevice)
{
    DEVICE_ENTRY(device, d);

    if (migDevice == NULL || d->slot >= 0 || index >= MIG_SLOTS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (get_mode() != M_MIG)
        return NVML_ERROR_NOT_SUPPORTED;
    if (index >= MIG_USED_SLOTS)
        return NVML_ERROR_NOT_FOUND;
    *migDevice = handle_of(&devs[MAX_GPUS + d->index * MIG_SLOTS + (int)index]);
    return NVML_SUCCESS;
}

/* ---- health --------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device,
                                       unsigned int *corrRows,
                                       unsigned int *uncRows,
                                       unsigned int *isPending,
                                       unsigned int *failureOccurred)
{
    DEVICE_ENTRY(device, d);

    if (corrRows == NULL || uncRows == NULL || isPending == NULL ||
        failureOccurred == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d->slot >= 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *corrRows = 0;
    *uncRows = 0;
    *isPending = get_mode() == M_REMAP && d->index == target_index() ? 1 : 0;
    *failureOccurred = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                    nvmlEnableState_t *isPending)
{
    DEVICE_ENTRY(device, d);

    if (isPending == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d->slot >= 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *isPending = get_mode() == M_RETIRED && d->index == target_index()
                 ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

/* Uncorrected errors (errorType 1), volatile (counterType 0): 2 on the
 * target GPU in mode ecc, else 0. */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device,
                                         nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType,
                                         unsigned long long *eccCounts)
{
    DEVICE_ENTRY(device, d);

    if (eccCounts == NULL ||
        (errorType != NVML_MEMORY_ERROR_TYPE_CORRECTED &&
         errorType != NVML_MEMORY_ERROR_TYPE_UNCORRECTED) ||
        (counterType != NVML_VOLATILE_ECC && counterType != NVML_AGGREGATE_ECC))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d->slot >= 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *eccCounts = (get_mode() == M_ECC &&
                  errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED &&
                  counterType == NVML_VOLATILE_ECC &&
                  d->index == target_index()) ? 2 : 0;
    return NVML_SUCCESS;
}

/* ---- the driver's own word: recovery action, NVLink fabric ---------- */

/* Field 230 only; every other field NOT_SUPPORTED, as a driver that does
 * not know a field id answers in that field's nvmlReturn. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                      nvmlFieldValue_t *values)
{
    int i;
    DEVICE_ENTRY(device, d);

    if (values == NULL || valuesCount < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (i = 0; i < valuesCount; i++) {
        values[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
#ifndef FAKE_OLD_DRIVER
        if (values[i].fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION &&
            d->slot < 0) {
            values[i].valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            values[i].value.uiVal = d->index == target_index()
                ? (unsigned int)env_int("FAKE_NVML_RECOVERY_ACTION", 0) : 0;
            values[i].nvmlReturn = NVML_SUCCESS;
        }
#endif
    }
    return NVML_SUCCESS;
}

#ifndef FAKE_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device,
                                         nvmlGpuFabricInfoV_t *gpuFabricInfo)
{
    const char *fabric = getenv("FAKE_NVML_FABRIC");
    unsigned int state = NVML_GPU_FABRIC_STATE_COMPLETED, status = 0;
    DEVICE_ENTRY(device, d);

    if (gpuFabricInfo == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (gpuFabricInfo->version != nvmlGpuFabricInfo_v2 &&
        (gpuFabricInfo->version != nvmlGpuFabricInfo_v3 ||
         getenv("FAKE_NVML_FABRIC_V2_ONLY") != NULL))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (fabric == NULL || d->slot >= 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (d->index == target_index() &&
        sscanf(fabric, "%u:%u", &state, &status) < 1)
        state = NVML_GPU_FABRIC_STATE_NOT_SUPPORTED;
    gpuFabricInfo->state = (nvmlGpuFabricState_t)state;
    gpuFabricInfo->status = (nvmlReturn_t)status;
    return NVML_SUCCESS;
}
#endif

/* ---- PCI ------------------------------------------------------------ */

/* GPU i on bus 0x61 + i of domain 0, in nvml.h's formats
 * (NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT "%04X:%02X:%02X.0" and
 * NVML_DEVICE_PCI_BUS_ID_FMT "%08X:%02X:%02X.0"); an H200's ids (device
 * 0x2335, vendor 0x10de). The script asks whole GPUs only (a MIG handle
 * gets its parent's here, untested against a real driver). */
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEVICE_ENTRY(device, d);

    if (pci == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    pci->domain = 0;
    pci->bus = 0x61u + (unsigned int)d->index;
    pci->device = 0;
    pci->pciDeviceId = 0x233510deu;
    pci->pciSubSystemId = 0x18be10deu;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0",
             pci->domain, pci->bus, pci->device);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0",
             pci->domain, pci->bus, pci->device);
    return NVML_SUCCESS;
}
