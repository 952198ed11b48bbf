/*
 * fake_nvml.c - a fake NVIDIA Management Library (libnvidia-ml.so.1) for gpufleet.
 *
 * What it is
 * ----------
 * A small shared library that exports a subset of the NVML C API with the exact
 * signatures and struct layouts that the real Python bindings (nvidia-ml-py, module
 * `pynvml`) use. Put the directory holding the built `libnvidia-ml.so.1` first on
 * LD_LIBRARY_PATH and pynvml loads this library instead of the driver's: gpufleet's NVML
 * code paths (inventory, samples, health, XID events) then run on machines without a GPU.
 * Build it and write its control file with the Python module next to this file
 * (gpufleet.recovery.fake_nvml).
 *
 * Everything a caller reads comes from a text "control file" whose path is taken from the
 * environment variable GPUFLEET_FAKE_NVML_CONTROL when NVML is initialised (nvmlInit*).
 * If the variable is unset or the file cannot be read, nvmlInit returns
 * NVML_ERROR_DRIVER_NOT_LOADED, as on a machine without the NVIDIA driver.
 *
 * The library stat()s the control file on every call that needs data and re-reads it when
 * its inode, size or mtime changed, so a test can change values while a process runs.
 * Writers must replace the file atomically (write a temporary file, then rename it over the
 * control file); the Python writer does. If the file disappears, the last state is kept.
 *
 * A process started with NVIDIA_VISIBLE_DEVICES (UUIDs or indices, comma-separated) sees
 * only those GPUs, renumbered from 0, as inside a container; gpufleet's sessions rely on it.
 * The list may also name MIG device UUIDs (MIG-...): see "MIG" below.
 *
 * Functions that are not exported here make pynvml raise NVMLError_FunctionNotFound, which
 * is what callers see with an old driver: only what gpufleet uses is implemented.
 *
 * Control-file format (format 1)
 * ------------------------------
 * UTF-8 text, one `key=value` per line. Blank lines and lines starting with '#' are ignored,
 * as are unknown keys (so newer writers stay readable). Numbers are decimal, or hexadecimal
 * with a 0x prefix. A string value is the rest of the line after the first '='.
 *
 *   format=1
 *   driver_version=550.54.15          nvmlSystemGetDriverVersion
 *   cuda_driver_version=12040         nvmlSystemGetCudaDriverVersion(_v2)
 *   gpu_count=2                       nvmlDeviceGetCount; GPUs are gpu.0 .. gpu.<count-1>
 *
 * Per GPU, prefixed by `gpu.<index>.` (the index is the NVML index):
 *
 *   uuid=GPU-...                      nvmlDeviceGetUUID, nvmlDeviceGetHandleByUUID
 *   name=NVIDIA A100-SXM4-80GB        nvmlDeviceGetName
 *   serial=1320000000000              nvmlDeviceGetSerial
 *   pci_bus_id=00000000:07:00.0       nvmlDeviceGetPciInfo_v3, ...GetHandleByPciBusId_v2
 *   pci_device_id=0x20B210DE          nvmlPciInfo_t.pciDeviceId
 *   pci_subsystem_id=0x147F10DE       nvmlPciInfo_t.pciSubSystemId
 *   memory_total_bytes=85899345920    nvmlDeviceGetMemoryInfo(_v2); free = total - used
 *   memory_used_bytes=0
 *   utilization_gpu=0                 nvmlDeviceGetUtilizationRates (percent)
 *   utilization_memory=0
 *   power_mw=60000                    nvmlDeviceGetPowerUsage (milliwatts)
 *   power_limit_mw=400000             nvmlDeviceGetEnforcedPowerLimit, ...PowerManagementLimit
 *   temperature_c=35                  nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)
 *   clocks_event_reasons=0            nvmlDeviceGetCurrentClocksEventReasons (bit mask)
 *   ecc_volatile_uncorrected=0        nvmlDeviceGetTotalEccErrors(type, counter)
 *   ecc_volatile_corrected=0
 *   ecc_aggregate_uncorrected=0
 *   ecc_aggregate_corrected=0
 *   remapped_rows_correctable=0       nvmlDeviceGetRemappedRows
 *   remapped_rows_uncorrectable=0
 *   remapped_rows_pending=0           0 or 1
 *   remapped_rows_failure=0           0 or 1
 *   pcie_replay_counter=0             nvmlDeviceGetPcieReplayCounter
 *   memory_reserved_bytes=0           nvmlDeviceGetMemoryInfo_v2's reserved (free = total -
 *                                     used - reserved there; the v1 call counts it as used)
 *   sm_clock_mhz=1410                 nvmlDeviceGetClockInfo(NVML_CLOCK_SM, _GRAPHICS)
 *   mem_clock_mhz=1593                nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)
 *   memory_temperature_c=45           nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)
 *   energy_mj=0                       nvmlDeviceGetTotalEnergyConsumption (and field 83)
 *   encoder_utilization=0             nvmlDeviceGetEncoderUtilization (percent)
 *   decoder_utilization=0             nvmlDeviceGetDecoderUtilization (percent)
 *   pcie_tx_kbps=0                    nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_TX_BYTES)
 *   pcie_rx_kbps=0                    ... (NVML_PCIE_UTIL_RX_BYTES), KB/s
 *   nvlink_tx_kib=0                   nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_THROUGHPUT_
 *   nvlink_rx_kib=0                   DATA_TX / _RX): data sent and received, all links, KiB
 *                                     (scope UINT_MAX; scope = a link: an even share of it)
 *   nvlink_links=12                   links 0..n-1 are active; 0: NVLink not supported
 *   nvlink_error=<link>,<counter>,<value>   repeatable; nvmlDeviceGetNvLinkErrorCounter
 *   cuda_compute_capability=8.0       nvmlDeviceGetCudaComputeCapability
 *   process=<pid>,<used_bytes>        repeatable; nvmlDeviceGetComputeRunningProcesses_v3
 *   lost=0                            1: every call on this GPU returns NVML_ERROR_GPU_IS_LOST
 *                                     (getting its handle too), the count still includes it
 *   xid=<seq>,<code>                  repeatable; a critical XID event to deliver (see below)
 *   mig=<uuid>,<profile>,<memory_total_bytes>,<memory_used_bytes>
 *                                     repeatable, at most 7 (later lines are ignored); one MIG
 *                                     device each, in MIG index order (see "MIG" below).
 *                                     The uuid and profile contain no ','; e.g.
 *                                     mig=MIG-1a2b...,1g.10gb,10737418240,0
 *   unsupported=<feature>             repeatable; calls for it return NVML_ERROR_NOT_SUPPORTED.
 *       Features: memory utilization power power_limit temperature clocks_event_reasons
 *       ecc remapped_rows pcie_replay_counter nvlink processes serial xid_events mig
 *       cuda_compute_capability clocks memory_temperature energy encoder decoder
 *       pcie_throughput
 *
 * XID events: nvmlDeviceRegisterEvents(dev, nvmlEventTypeXidCriticalError, set) and then
 * nvmlEventSetWait_v2(set, &data, timeout_ms). The wait re-reads the control file every
 * 20 ms until the timeout, and returns the pending `xid` line with the lowest sequence
 * number among the registered GPUs (eventData = the XID code). Each event set delivers a
 * given (GPU, seq) once: it remembers the highest sequence number it delivered per GPU, so
 * writers must give every new XID a larger sequence number than the ones before it for
 * that GPU. XIDs already listed when the set registers are delivered too (a test may write
 * the XID before the process under test starts waiting).
 *
 * MIG: a GPU with at least one `mig` line is in MIG mode (unless `unsupported=mig`, which
 * makes it a GPU without MIG support and its `mig` lines are ignored):
 *   nvmlDeviceGetMigMode                 current = pending = NVML_DEVICE_MIG_ENABLE (1); a GPU
 *                                        without `mig` lines: NVML_DEVICE_MIG_DISABLE (0)
 *   nvmlDeviceGetMaxMigDeviceCount       7; NVML_ERROR_NOT_SUPPORTED without MIG mode
 *   nvmlDeviceGetMigDeviceHandleByIndex  the index-th `mig` line; NVML_ERROR_NOT_FOUND for
 *                                        index >= the number of lines (< 7), INVALID_ARGUMENT
 *                                        from 7 on, NOT_SUPPORTED without MIG mode
 *   nvmlDeviceGetHandleByUUID            also finds MIG devices by their uuid
 *   nvmlDeviceIsMigDeviceHandle, nvmlDeviceGetDeviceHandleFromMigDeviceHandle
 * A MIG device handle is its own opaque pointer (never a GPU's). Calls that accept one:
 * nvmlDeviceGetUUID (the MIG uuid), nvmlDeviceGetName ("<GPU name> MIG <profile>"),
 * nvmlDeviceGetMemoryInfo(_v2) (the MIG's memory), the two above, and nvmlDeviceGetIndex
 * and nvmlDeviceGetUtilizationRates, which return NVML_ERROR_NOT_SUPPORTED for it (as on
 * real MIG). Every other call returns NVML_ERROR_INVALID_ARGUMENT for a MIG handle. A MIG
 * handle whose GPU is lost, or whose `mig` line is gone, returns NVML_ERROR_GPU_IS_LOST;
 * `unsupported` features of the GPU apply to its MIG devices too. nvmlDeviceGetCount and
 * nvmlDeviceGetHandleByIndex still count and return whole GPUs only, as in real NVML.
 * NVIDIA_VISIBLE_DEVICES may name MIG uuids: a GPU one of whose MIG devices is named is
 * kept with only its named MIG devices (renumbered from 0 in control-file order), even if
 * the GPU itself is named too; a GPU named (by uuid or index) with none of its MIG devices
 * named is kept whole.
 *
 * All state is guarded by one mutex, so one thread may sample while another waits for
 * events.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------ NVML types */

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_TEMPERATURE_GPU 0
#define NVML_MEMORY_ERROR_TYPE_CORRECTED 0
#define NVML_MEMORY_ERROR_TYPE_UNCORRECTED 1
#define NVML_VOLATILE_ECC 0
#define NVML_AGGREGATE_ECC 1
#define NVML_NVLINK_ERROR_COUNT 5
#define NVML_DEVICE_MIG_DISABLE 0
#define NVML_DEVICE_MIG_ENABLE 1
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu
#define nvmlEventTypeXidCriticalError 0x0000000000000008ULL

struct fake_gpu;
struct fake_event_set;
typedef struct fake_gpu *nvmlDevice_t;
typedef struct fake_event_set *nvmlEventSet_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define NVML_STRUCT_VERSION(size, ver) ((unsigned int)(size) | ((unsigned int)(ver) << 24))
#define nvmlMemory_v2 NVML_STRUCT_VERSION(sizeof(nvmlMemory_v2_t), 2)

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

/* nvmlProcessInfo_v2_t; nvmlProcessInfo_t (v3) has the same layout. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/* The layouts pynvml declares with ctypes (x86-64 / aarch64 Linux). */
_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t");

/* ------------------------------------------------------------------ fake state */

#define MAX_GPUS 32
#define MAX_PROCS 64
#define MAX_XIDS 64
#define MAX_LINKS 36
#define MAX_MIGS 7 /* NVML's most MIG devices per GPU (A100, H100) */
#define EVENT_POLL_MS 20

/* Features a control file can mark unsupported (bit per feature). */
enum {
    F_NONE = 0,
    F_MEMORY = 1 << 0,
    F_UTILIZATION = 1 << 1,
    F_POWER = 1 << 2,
    F_POWER_LIMIT = 1 << 3,
    F_TEMPERATURE = 1 << 4,
    F_CLOCKS_EVENT_REASONS = 1 << 5,
    F_ECC = 1 << 6,
    F_REMAPPED_ROWS = 1 << 7,
    F_PCIE_REPLAY = 1 << 8,
    F_NVLINK = 1 << 9,
    F_PROCESSES = 1 << 10,
    F_SERIAL = 1 << 11,
    F_XID_EVENTS = 1 << 12,
    F_MIG = 1 << 13,
    F_COMPUTE_CAPABILITY = 1 << 14,
    F_CLOCKS = 1 << 15,
    F_MEMORY_TEMPERATURE = 1 << 16,
    F_ENERGY = 1 << 17,
    F_ENCODER = 1 << 18,
    F_DECODER = 1 << 19,
    F_PCIE_THROUGHPUT = 1 << 20,
};

static const struct {
    const char *name;
    unsigned int bit;
} FEATURES[] = {
    {"memory", F_MEMORY},
    {"utilization", F_UTILIZATION},
    {"power", F_POWER},
    {"power_limit", F_POWER_LIMIT},
    {"temperature", F_TEMPERATURE},
    {"clocks_event_reasons", F_CLOCKS_EVENT_REASONS},
    {"ecc", F_ECC},
    {"remapped_rows", F_REMAPPED_ROWS},
    {"pcie_replay_counter", F_PCIE_REPLAY},
    {"nvlink", F_NVLINK},
    {"processes", F_PROCESSES},
    {"serial", F_SERIAL},
    {"xid_events", F_XID_EVENTS},
    {"mig", F_MIG},
    {"cuda_compute_capability", F_COMPUTE_CAPABILITY},
    {"clocks", F_CLOCKS},
    {"memory_temperature", F_MEMORY_TEMPERATURE},
    {"energy", F_ENERGY},
    {"encoder", F_ENCODER},
    {"decoder", F_DECODER},
    {"pcie_throughput", F_PCIE_THROUGHPUT},
};

struct fake_process {
    unsigned int pid;
    unsigned long long used;
};

struct fake_xid {
    unsigned long long seq;
    unsigned long long code;
};

struct fake_mig {
    char uuid[96];
    char profile[32]; /* "1g.10gb" */
    unsigned long long memory_total, memory_used;
};

struct fake_gpu {
    char uuid[96];
    char name[96];
    char serial[30];
    char bus_id[32];        /* "00000000:07:00.0" */
    char bus_id_legacy[16]; /* "0000:07:00.0" */
    unsigned int domain, bus, device, function;
    unsigned int pci_device_id, pci_subsystem_id;
    unsigned long long memory_total, memory_used;
    unsigned int utilization_gpu, utilization_memory;
    unsigned int power_mw, power_limit_mw, temperature_c;
    unsigned long long clocks_event_reasons;
    unsigned long long ecc[2][2]; /* [error type: corrected, uncorrected][volatile, aggregate] */
    unsigned int remapped_correctable, remapped_uncorrectable;
    unsigned int remapped_pending, remapped_failure;
    unsigned int pcie_replay_counter;
    unsigned long long memory_reserved;
    unsigned int sm_clock_mhz, mem_clock_mhz, memory_temperature_c;
    unsigned long long energy_mj;
    unsigned int encoder_utilization, decoder_utilization;
    unsigned int pcie_tx_kbps, pcie_rx_kbps;
    unsigned long long nvlink_tx_kib, nvlink_rx_kib;
    unsigned int nvlink_links;
    unsigned long long nvlink_errors[MAX_LINKS][NVML_NVLINK_ERROR_COUNT];
    int cc_major, cc_minor;
    unsigned int nprocs;
    struct fake_process procs[MAX_PROCS];
    unsigned int nxids;
    struct fake_xid xids[MAX_XIDS];
    int lost;
    unsigned int unsupported; /* F_* bits */
    unsigned int nmigs;
    struct fake_mig migs[MAX_MIGS];
};

struct fake_state {
    char driver_version[80];
    int cuda_driver_version;
    unsigned int count;
    struct fake_gpu gpus[MAX_GPUS];
};

struct fake_event_set {
    unsigned long long types[MAX_GPUS];     /* registered event types per GPU slot */
    unsigned long long delivered[MAX_GPUS]; /* highest XID seq delivered per GPU slot */
    struct fake_event_set *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_refcount;
static char g_control_path[4096];
static struct {
    int valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
} g_stamp;
static char g_driver_version[80];
static int g_cuda_driver_version;
static unsigned int g_count;
/* Device handles are pointers into this array; it is overwritten in place on re-read. */
static struct fake_gpu g_gpus[MAX_GPUS];
/* MIG device handles are pointers into this array, one per (GPU slot, MIG index). They are
 * never dereferenced: being outside g_gpus, calls that need a whole GPU reject them. */
static struct fake_mig_handle {
    unsigned long long unused; /* aligned like struct fake_gpu, whose pointer type it takes */
} g_mig_handles[MAX_GPUS][MAX_MIGS];
static struct fake_event_set *g_event_sets;

/* ------------------------------------------------------------------ control file */

/* Decimal, or hexadecimal with 0x (never octal: "010" is ten). */
static int parse_u64(const char *s, unsigned long long *out) {
    char *end;
    int base = 10;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
        base = 16;
    errno = 0;
    unsigned long long v = strtoull(s, &end, base);
    if (errno || end == s || *end != '\0')
        return 0;
    *out = v;
    return 1;
}

static int parse_u32(const char *s, unsigned int *out) {
    unsigned long long v;
    if (!parse_u64(s, &v) || v > 0xFFFFFFFFull)
        return 0;
    *out = (unsigned int)v;
    return 1;
}

static void copy_str(char *dst, size_t size, const char *src) {
    snprintf(dst, size, "%s", src);
}

static void set_bus_id(struct fake_gpu *g, const char *value) {
    unsigned int domain, bus, device, function;
    char extra;
    if (sscanf(value, "%x:%x:%x.%x%c", &domain, &bus, &device, &function, &extra) == 4) {
        g->domain = domain;
        g->bus = bus;
        g->device = device;
        g->function = function;
        snprintf(g->bus_id, sizeof g->bus_id, "%08X:%02X:%02X.%X", domain, bus, device, function);
        snprintf(g->bus_id_legacy, sizeof g->bus_id_legacy, "%04X:%02X:%02X.%X", domain & 0xFFFF,
                 bus & 0xFF, device & 0xFF, function & 0xF);
    } else {
        copy_str(g->bus_id, sizeof g->bus_id, value);
        copy_str(g->bus_id_legacy, sizeof g->bus_id_legacy, value);
    }
}

static void gpu_defaults(struct fake_gpu *g, unsigned int index) {
    char bus_id[32];
    memset(g, 0, sizeof *g);
    snprintf(g->uuid, sizeof g->uuid, "GPU-00000000-0000-0000-0000-%012u", index);
    copy_str(g->name, sizeof g->name, "NVIDIA A100-SXM4-80GB");
    snprintf(g->serial, sizeof g->serial, "%u", 1320000000u + index);
    snprintf(bus_id, sizeof bus_id, "00000000:%02X:00.0", 0x07 + index);
    set_bus_id(g, bus_id);
    g->pci_device_id = 0x20B210DE;
    g->pci_subsystem_id = 0x147F10DE;
    g->memory_total = 85899345920ull;
    g->power_mw = 60000;
    g->power_limit_mw = 400000;
    g->temperature_c = 35;
    g->sm_clock_mhz = 1410;
    g->mem_clock_mhz = 1593;
    g->memory_temperature_c = 45;
    g->nvlink_links = 12;
    g->cc_major = 8;
    g->cc_minor = 0;
}

/* Returns 0 for an unknown key or a malformed value (the line is then ignored). */
static int set_gpu_field(struct fake_gpu *g, const char *key, const char *value) {
    unsigned long long a, b, c;
    unsigned int u;
    char *end;

#define U32(field) return parse_u32(value, &g->field)
#define U64(field) return parse_u64(value, &g->field)
    if (!strcmp(key, "uuid")) {
        copy_str(g->uuid, sizeof g->uuid, value);
        return 1;
    }
    if (!strcmp(key, "name")) {
        copy_str(g->name, sizeof g->name, value);
        return 1;
    }
    if (!strcmp(key, "serial")) {
        copy_str(g->serial, sizeof g->serial, value);
        return 1;
    }
    if (!strcmp(key, "pci_bus_id")) {
        set_bus_id(g, value);
        return 1;
    }
    if (!strcmp(key, "pci_device_id")) U32(pci_device_id);
    if (!strcmp(key, "pci_subsystem_id")) U32(pci_subsystem_id);
    if (!strcmp(key, "memory_total_bytes")) U64(memory_total);
    if (!strcmp(key, "memory_used_bytes")) U64(memory_used);
    if (!strcmp(key, "utilization_gpu")) U32(utilization_gpu);
    if (!strcmp(key, "utilization_memory")) U32(utilization_memory);
    if (!strcmp(key, "power_mw")) U32(power_mw);
    if (!strcmp(key, "power_limit_mw")) U32(power_limit_mw);
    if (!strcmp(key, "temperature_c")) U32(temperature_c);
    if (!strcmp(key, "clocks_event_reasons")) U64(clocks_event_reasons);
    if (!strcmp(key, "ecc_volatile_corrected")) U64(ecc[0][0]);
    if (!strcmp(key, "ecc_aggregate_corrected")) U64(ecc[0][1]);
    if (!strcmp(key, "ecc_volatile_uncorrected")) U64(ecc[1][0]);
    if (!strcmp(key, "ecc_aggregate_uncorrected")) U64(ecc[1][1]);
    if (!strcmp(key, "remapped_rows_correctable")) U32(remapped_correctable);
    if (!strcmp(key, "remapped_rows_uncorrectable")) U32(remapped_uncorrectable);
    if (!strcmp(key, "remapped_rows_pending")) U32(remapped_pending);
    if (!strcmp(key, "remapped_rows_failure")) U32(remapped_failure);
    if (!strcmp(key, "pcie_replay_counter")) U32(pcie_replay_counter);
    if (!strcmp(key, "memory_reserved_bytes")) U64(memory_reserved);
    if (!strcmp(key, "sm_clock_mhz")) U32(sm_clock_mhz);
    if (!strcmp(key, "mem_clock_mhz")) U32(mem_clock_mhz);
    if (!strcmp(key, "memory_temperature_c")) U32(memory_temperature_c);
    if (!strcmp(key, "energy_mj")) U64(energy_mj);
    if (!strcmp(key, "encoder_utilization")) U32(encoder_utilization);
    if (!strcmp(key, "decoder_utilization")) U32(decoder_utilization);
    if (!strcmp(key, "pcie_tx_kbps")) U32(pcie_tx_kbps);
    if (!strcmp(key, "pcie_rx_kbps")) U32(pcie_rx_kbps);
    if (!strcmp(key, "nvlink_tx_kib")) U64(nvlink_tx_kib);
    if (!strcmp(key, "nvlink_rx_kib")) U64(nvlink_rx_kib);
    if (!strcmp(key, "lost")) {
        if (!parse_u32(value, &u))
            return 0;
        g->lost = u != 0;
        return 1;
    }
    if (!strcmp(key, "nvlink_links")) {
        if (!parse_u32(value, &u) || u > MAX_LINKS)
            return 0;
        g->nvlink_links = u;
        return 1;
    }
#undef U32
#undef U64
    if (!strcmp(key, "nvlink_error")) {
        if (sscanf(value, "%llu,%llu,%llu", &a, &b, &c) != 3 || a >= MAX_LINKS ||
            b >= NVML_NVLINK_ERROR_COUNT)
            return 0;
        g->nvlink_errors[a][b] = c;
        return 1;
    }
    if (!strcmp(key, "cuda_compute_capability")) {
        long major = strtol(value, &end, 10);
        if (end == value || *end != '.')
            return 0;
        const char *minor_start = end + 1;
        long minor = strtol(minor_start, &end, 10);
        if (end == minor_start || *end != '\0')
            return 0;
        g->cc_major = (int)major;
        g->cc_minor = (int)minor;
        return 1;
    }
    if (!strcmp(key, "process")) {
        if (sscanf(value, "%llu,%llu", &a, &b) != 2 || g->nprocs >= MAX_PROCS)
            return 0;
        g->procs[g->nprocs].pid = (unsigned int)a;
        g->procs[g->nprocs].used = b;
        g->nprocs++;
        return 1;
    }
    if (!strcmp(key, "xid")) {
        if (sscanf(value, "%llu,%llu", &a, &b) != 2 || g->nxids >= MAX_XIDS)
            return 0;
        g->xids[g->nxids].seq = a;
        g->xids[g->nxids].code = b;
        g->nxids++;
        return 1;
    }
    if (!strcmp(key, "mig")) {
        /* <uuid>,<profile>,<memory_total_bytes>,<memory_used_bytes> */
        char copy[256];
        char *save = NULL;
        if (g->nmigs >= MAX_MIGS || strlen(value) >= sizeof copy)
            return 0;
        copy_str(copy, sizeof copy, value);
        char *uuid = strtok_r(copy, ",", &save);
        char *profile = strtok_r(NULL, ",", &save);
        char *total = strtok_r(NULL, ",", &save);
        char *used = strtok_r(NULL, ",", &save);
        if (!used || strtok_r(NULL, ",", &save) || !parse_u64(total, &a) || !parse_u64(used, &b))
            return 0;
        struct fake_mig *m = &g->migs[g->nmigs];
        copy_str(m->uuid, sizeof m->uuid, uuid);
        copy_str(m->profile, sizeof m->profile, profile);
        m->memory_total = a;
        m->memory_used = b;
        g->nmigs++;
        return 1;
    }
    if (!strcmp(key, "unsupported")) {
        for (size_t i = 0; i < sizeof FEATURES / sizeof FEATURES[0]; i++) {
            if (!strcmp(value, FEATURES[i].name)) {
                g->unsupported |= FEATURES[i].bit;
                return 1;
            }
        }
        return 0;
    }
    return 0;
}

static void parse_line(struct fake_state *st, char *line) {
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r'))
        line[--n] = '\0';
    if (!n || line[0] == '#')
        return;
    char *eq = strchr(line, '=');
    if (!eq)
        return;
    *eq = '\0';
    const char *key = line, *value = eq + 1;
    unsigned int u;

    if (!strcmp(key, "driver_version")) {
        copy_str(st->driver_version, sizeof st->driver_version, value);
    } else if (!strcmp(key, "cuda_driver_version")) {
        if (parse_u32(value, &u))
            st->cuda_driver_version = (int)u;
    } else if (!strcmp(key, "gpu_count")) {
        if (parse_u32(value, &u))
            st->count = u < MAX_GPUS ? u : MAX_GPUS;
    } else if (!strncmp(key, "gpu.", 4)) {
        char *end;
        unsigned long index = strtoul(key + 4, &end, 10);
        if (end != key + 4 && *end == '.' && index < MAX_GPUS)
            set_gpu_field(&st->gpus[index], end + 1, value);
    }
}

/* Whether `list` (NVIDIA_VISIBLE_DEVICES: comma-separated UUIDs or indices) names `what`. */
static int listed(const char *list, const char *what) {
    char copy[4096];
    char *save = NULL;
    if (!*what)
        return 0;
    copy_str(copy, sizeof copy, list);
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        if (strcmp(tok, what) == 0)
            return 1;
    }
    return 0;
}

/* Whether `list` keeps GPU `g` (at control-file index `index`). When it names MIG devices
 * of `g`, only those are kept (in their order); otherwise `g` is kept whole if named. */
static int visible_gpu(const char *list, struct fake_gpu *g, unsigned int index) {
    char number[16];
    unsigned int kept = 0;
    for (unsigned int j = 0; j < g->nmigs; j++) {
        if (listed(list, g->migs[j].uuid)) {
            if (kept != j)
                g->migs[kept] = g->migs[j];
            kept++;
        }
    }
    if (kept) {
        g->nmigs = kept;
        return 1;
    }
    snprintf(number, sizeof number, "%u", index);
    return listed(list, g->uuid) || listed(list, number);
}

/* Like the NVIDIA container runtime: a process started with NVIDIA_VISIBLE_DEVICES sees
 * only the GPUs it names (unset, empty or "all": every GPU; "none" or "void": none). The
 * GPUs it keeps are numbered from 0 in control-file order, so a session's NVML shows
 * exactly the GPUs gpufleet gave it. Naming a MIG uuid keeps its GPU with only the named
 * MIG devices (see visible_gpu). */
static void apply_visibility(struct fake_state *st) {
    const char *visible = getenv("NVIDIA_VISIBLE_DEVICES");
    if (!visible || !*visible || strcmp(visible, "all") == 0)
        return;
    unsigned int kept = 0;
    for (unsigned int i = 0; i < st->count; i++) {
        if (strcmp(visible, "none") != 0 && strcmp(visible, "void") != 0 &&
            visible_gpu(visible, &st->gpus[i], i)) {
            if (kept != i)
                st->gpus[kept] = st->gpus[i];
            kept++;
        }
    }
    st->count = kept;
}

/* Re-read the control file if it changed since the last read. Caller holds g_lock.
 * Returns 0 when the file could not be read (the previous state is kept). */
static int refresh_locked(void) {
    struct stat sb;
    if (stat(g_control_path, &sb) != 0)
        return 0;
    if (g_stamp.valid && sb.st_dev == g_stamp.dev && sb.st_ino == g_stamp.ino &&
        sb.st_size == g_stamp.size && sb.st_mtim.tv_sec == g_stamp.mtime.tv_sec &&
        sb.st_mtim.tv_nsec == g_stamp.mtime.tv_nsec)
        return 1;

    FILE *f = fopen(g_control_path, "r");
    if (!f)
        return 0;
    if (fstat(fileno(f), &sb) != 0) { /* stamp what we actually read */
        fclose(f);
        return 0;
    }
    struct fake_state *st = malloc(sizeof *st);
    if (!st) {
        fclose(f);
        return 0;
    }
    memset(st, 0, sizeof *st);
    copy_str(st->driver_version, sizeof st->driver_version, "550.54.15");
    st->cuda_driver_version = 12040;
    for (unsigned int i = 0; i < MAX_GPUS; i++)
        gpu_defaults(&st->gpus[i], i);

    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) != -1)
        parse_line(st, line);
    free(line);
    fclose(f);
    apply_visibility(st);

    memcpy(g_driver_version, st->driver_version, sizeof g_driver_version);
    g_cuda_driver_version = st->cuda_driver_version;
    g_count = st->count;
    memcpy(g_gpus, st->gpus, sizeof g_gpus);
    free(st);

    g_stamp.valid = 1;
    g_stamp.dev = sb.st_dev;
    g_stamp.ino = sb.st_ino;
    g_stamp.size = sb.st_size;
    g_stamp.mtime = sb.st_mtim;
    return 1;
}

/* ------------------------------------------------------------------ call helpers */

static nvmlReturn_t unlock_with(nvmlReturn_t rc) {
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Lock, check initialisation and refresh. On failure the lock is released. */
static nvmlReturn_t begin(void) {
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        return unlock_with(NVML_ERROR_UNINITIALIZED);
    refresh_locked();
    return NVML_SUCCESS;
}

static int slot_of(nvmlDevice_t device) {
    if (!device)
        return -1;
    ptrdiff_t offset = (const char *)device - (const char *)g_gpus;
    if (offset < 0 || offset >= (ptrdiff_t)sizeof g_gpus || offset % sizeof g_gpus[0])
        return -1;
    return (int)(offset / (ptrdiff_t)sizeof g_gpus[0]);
}

/* Whether a GPU is in MIG mode: it has MIG devices and MIG is not marked unsupported. */
static int mig_enabled(const struct fake_gpu *g) {
    return g->nmigs > 0 && !(g->unsupported & F_MIG);
}

static nvmlDevice_t mig_handle(unsigned int slot, unsigned int index) {
    return (nvmlDevice_t)(void *)&g_mig_handles[slot][index];
}

/* The (GPU slot, MIG index) of a MIG device handle; -1 if `device` is not one. */
static int mig_of(nvmlDevice_t device, unsigned int *index) {
    if (!device)
        return -1;
    ptrdiff_t offset = (const char *)device - (const char *)g_mig_handles;
    ptrdiff_t size = (ptrdiff_t)sizeof g_mig_handles[0][0];
    if (offset < 0 || offset >= (ptrdiff_t)sizeof g_mig_handles || offset % size)
        return -1;
    *index = (unsigned int)(offset / size % MAX_MIGS);
    return (int)(offset / size / MAX_MIGS);
}

/* begin(), then resolve a device handle: invalid handle, lost GPU (or one that left the
 * control file) and unsupported feature are reported here. A MIG device handle is accepted
 * only when `mig` is not NULL; *mig is then the MIG device, or NULL for a whole GPU, and
 * *gpu its GPU. On failure the lock is released. */
static nvmlReturn_t begin_handle(nvmlDevice_t device, unsigned int feature,
                                 struct fake_gpu **gpu, struct fake_mig **mig) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int mig_index = 0;
    int is_mig = 0;
    int slot = slot_of(device);
    if (slot < 0 && mig) {
        slot = mig_of(device, &mig_index);
        is_mig = 1;
    }
    if (slot < 0)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    if ((unsigned int)slot >= g_count || g_gpus[slot].lost)
        return unlock_with(NVML_ERROR_GPU_IS_LOST);
    if (is_mig && (!mig_enabled(&g_gpus[slot]) || mig_index >= g_gpus[slot].nmigs))
        return unlock_with(NVML_ERROR_GPU_IS_LOST); /* its `mig` line is gone */
    if (g_gpus[slot].unsupported & feature)
        return unlock_with(NVML_ERROR_NOT_SUPPORTED);
    *gpu = &g_gpus[slot];
    if (mig)
        *mig = is_mig ? &g_gpus[slot].migs[mig_index] : NULL;
    return NVML_SUCCESS;
}

/* begin_handle for calls that need a whole GPU (a MIG handle is INVALID_ARGUMENT). */
static nvmlReturn_t begin_device(nvmlDevice_t device, unsigned int feature,
                                 struct fake_gpu **gpu) {
    return begin_handle(device, feature, gpu, NULL);
}

static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src) {
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ init, system */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0) {
        const char *path = getenv("GPUFLEET_FAKE_NVML_CONTROL");
        if (!path || !*path || strlen(path) >= sizeof g_control_path)
            return unlock_with(NVML_ERROR_DRIVER_NOT_LOADED);
        copy_str(g_control_path, sizeof g_control_path, path);
        g_stamp.valid = 0;
        if (!refresh_locked())
            return unlock_with(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    g_refcount++;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        return unlock_with(NVML_ERROR_UNINITIALIZED);
    g_refcount--;
    return unlock_with(NVML_SUCCESS);
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not Ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    return unlock_with(copy_out(version, length, g_driver_version));
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    char buf[96];
    snprintf(buf, sizeof buf, "%d.%s", g_cuda_driver_version / 1000, g_driver_version);
    return unlock_with(copy_out(version, length, buf));
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!version)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *version = g_cuda_driver_version;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    return nvmlSystemGetCudaDriverVersion(version);
}

/* ------------------------------------------------------------------ device handles */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!count)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *count = g_count;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

/* A lost GPU is counted, but its handle cannot be obtained (as with the real driver). */
static nvmlReturn_t handle_for_slot(unsigned int slot, nvmlDevice_t *device) {
    if (g_gpus[slot].lost)
        return NVML_ERROR_GPU_IS_LOST;
    *device = &g_gpus[slot];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!device || index >= g_count)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    return unlock_with(handle_for_slot(index, device));
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!uuid || !device)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned int i = 0; i < g_count; i++)
        if (!strcmp(g_gpus[i].uuid, uuid))
            return unlock_with(handle_for_slot(i, device));
    for (unsigned int i = 0; i < g_count; i++) {
        const struct fake_gpu *g = &g_gpus[i];
        for (unsigned int j = 0; mig_enabled(g) && j < g->nmigs; j++) {
            if (!strcmp(g->migs[j].uuid, uuid)) {
                if (g->lost)
                    return unlock_with(NVML_ERROR_GPU_IS_LOST);
                *device = mig_handle(i, j);
                return unlock_with(NVML_SUCCESS);
            }
        }
    }
    return unlock_with(NVML_ERROR_NOT_FOUND);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pciBusId || !device)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int domain, bus, dev, function = 0;
    int n = sscanf(pciBusId, "%x:%x:%x.%x", &domain, &bus, &dev, &function);
    if (n < 3)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned int i = 0; i < g_count; i++) {
        const struct fake_gpu *g = &g_gpus[i];
        if (g->domain == domain && g->bus == bus && g->device == dev && g->function == function)
            return unlock_with(handle_for_slot(i, device));
    }
    return unlock_with(NVML_ERROR_NOT_FOUND);
}

/* ------------------------------------------------------------------ identity */

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    struct fake_gpu *g;
    struct fake_mig *m;
    nvmlReturn_t rc = begin_handle(device, F_NONE, &g, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (m)
        return unlock_with(NVML_ERROR_NOT_SUPPORTED);
    if (!index)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)(g - g_gpus);
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    struct fake_gpu *g;
    struct fake_mig *m;
    nvmlReturn_t rc = begin_handle(device, F_NONE, &g, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    return unlock_with(copy_out(uuid, length, m ? m->uuid : g->uuid));
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    struct fake_gpu *g;
    struct fake_mig *m;
    nvmlReturn_t rc = begin_handle(device, F_NONE, &g, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!m)
        return unlock_with(copy_out(name, length, g->name));
    char mig_name[sizeof g->name + sizeof m->profile + 8];
    snprintf(mig_name, sizeof mig_name, "%s MIG %s", g->name, m->profile);
    return unlock_with(copy_out(name, length, mig_name));
}

EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_SERIAL, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    return unlock_with(copy_out(serial, length, g->serial));
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_NONE, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pci)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    copy_str(pci->busIdLegacy, sizeof pci->busIdLegacy, g->bus_id_legacy);
    copy_str(pci->busId, sizeof pci->busId, g->bus_id);
    pci->domain = g->domain;
    pci->bus = g->bus;
    pci->device = g->device;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
                                                       int *minor) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_COMPUTE_CAPABILITY, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!major || !minor)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *major = g->cc_major;
    *minor = g->cc_minor;
    return unlock_with(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ readings */

/* The memory of a GPU or, when `m` is not NULL, of one of its MIG devices. */
static void memory_of(const struct fake_gpu *g, const struct fake_mig *m,
                      unsigned long long *total, unsigned long long *used) {
    *total = m ? m->memory_total : g->memory_total;
    *used = m ? m->memory_used : g->memory_used;
    if (*used > *total)
        *used = *total;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    struct fake_gpu *g;
    struct fake_mig *m;
    nvmlReturn_t rc = begin_handle(device, F_MEMORY, &g, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!memory)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    memory_of(g, m, &memory->total, &memory->used);
    if (!m) /* the v1 call knows no reserved memory: it counts it as used */
        memory->used += g->memory_reserved < memory->total - memory->used
                            ? g->memory_reserved
                            : memory->total - memory->used;
    memory->free = memory->total - memory->used;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    struct fake_gpu *g;
    struct fake_mig *m;
    nvmlReturn_t rc = begin_handle(device, F_MEMORY, &g, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!memory)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2)
        return unlock_with(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory_of(g, m, &memory->total, &memory->used);
    memory->reserved = m ? 0 : g->memory_reserved;
    if (memory->reserved > memory->total - memory->used)
        memory->reserved = memory->total - memory->used;
    memory->free = memory->total - memory->used - memory->reserved;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    struct fake_gpu *g;
    struct fake_mig *m;
    nvmlReturn_t rc = begin_handle(device, F_UTILIZATION, &g, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (m) /* real NVML has no utilization per MIG device */
        return unlock_with(NVML_ERROR_NOT_SUPPORTED);
    if (!util)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    util->gpu = g->utilization_gpu;
    util->memory = g->utilization_memory;
    return unlock_with(NVML_SUCCESS);
}

/* The many NVML getters that return one unsigned int field. */
static nvmlReturn_t get_uint(nvmlDevice_t device, unsigned int feature, size_t offset,
                             unsigned int *out) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, feature, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!out)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    memcpy(out, (const char *)g + offset, sizeof *out);
    return unlock_with(NVML_SUCCESS);
}

#define GET_UINT(device, feature, field, out) \
    get_uint(device, feature, offsetof(struct fake_gpu, field), out)

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    return GET_UINT(device, F_POWER, power_mw, power);
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    return GET_UINT(device, F_POWER_LIMIT, power_limit_mw, limit);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit) {
    return GET_UINT(device, F_POWER_LIMIT, power_limit_mw, limit);
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value) {
    return GET_UINT(device, F_PCIE_REPLAY, pcie_replay_counter, value);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    if (sensor != NVML_TEMPERATURE_GPU) {
        /* Still report uninitialised / lost / unsupported first, like the driver. */
        struct fake_gpu *g;
        nvmlReturn_t rc = begin_device(device, F_TEMPERATURE, &g);
        if (rc != NVML_SUCCESS)
            return rc;
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    }
    return GET_UINT(device, F_TEMPERATURE, temperature_c, temp);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                           unsigned long long *reasons) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_CLOCKS_EVENT_REASONS, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!reasons)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *reasons = g->clocks_event_reasons;
    return unlock_with(NVML_SUCCESS);
}

/* The older name of the same call (drivers before 535 only have this one). */
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                              unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

/* ------------------------------------------------------------------ telemetry */

#define NVML_CLOCK_GRAPHICS 0
#define NVML_CLOCK_SM 1
#define NVML_CLOCK_MEM 2
#define NVML_PCIE_UTIL_TX_BYTES 0
#define NVML_PCIE_UTIL_RX_BYTES 1
#define NVML_FI_DEV_MEMORY_TEMP 82
#define NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION 83
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX 138
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX 139
#define NVML_ALL_LINKS 0xFFFFFFFFu
#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    union {
        double dVal;
        unsigned int uiVal;
        unsigned long ulVal;
        unsigned long long ullVal;
        long long sllVal;
        int siVal;
    } value;
} nvmlFieldValue_t;

_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t");

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_CLOCKS, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!clock)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    if (type == NVML_CLOCK_SM || type == NVML_CLOCK_GRAPHICS)
        *clock = g->sm_clock_mhz;
    else if (type == NVML_CLOCK_MEM)
        *clock = g->mem_clock_mhz;
    else
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                        unsigned long long *energy) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_ENERGY, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!energy)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *energy = g->energy_mj;
    return unlock_with(NVML_SUCCESS);
}

/* The encoder's and decoder's utilisation over NVML's sampling period (a sixth of a s). */
static nvmlReturn_t video_utilization(nvmlDevice_t device, unsigned int feature, size_t offset,
                                      unsigned int *utilization, unsigned int *period_us) {
    if (!period_us)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = get_uint(device, feature, offset, utilization);
    if (rc == NVML_SUCCESS)
        *period_us = 167000;
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *period_us) {
    return video_utilization(device, F_ENCODER, offsetof(struct fake_gpu, encoder_utilization),
                             utilization, period_us);
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *period_us) {
    return video_utilization(device, F_DECODER, offsetof(struct fake_gpu, decoder_utilization),
                             utilization, period_us);
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, int counter,
                                                unsigned int *value) {
    if (counter == NVML_PCIE_UTIL_TX_BYTES)
        return GET_UINT(device, F_PCIE_THROUGHPUT, pcie_tx_kbps, value);
    if (counter == NVML_PCIE_UTIL_RX_BYTES)
        return GET_UINT(device, F_PCIE_THROUGHPUT, pcie_rx_kbps, value);
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* One field: its value, or why not, in the field's own nvmlReturn (as the driver does). */
static void field_value(const struct fake_gpu *g, nvmlFieldValue_t *f) {
    unsigned int feature = F_NONE;
    unsigned long long value = 0;
    int type = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
    switch (f->fieldId) {
    case NVML_FI_DEV_MEMORY_TEMP:
        feature = F_MEMORY_TEMPERATURE;
        value = g->memory_temperature_c;
        type = NVML_VALUE_TYPE_UNSIGNED_INT;
        break;
    case NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
        feature = F_ENERGY;
        value = g->energy_mj;
        break;
    case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
    case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
        /* The scope is a link; UINT_MAX, all of them. The GPU's total is spread evenly over
           its links (link 0 takes what does not divide). */
        if (!g->nvlink_links || (f->scopeId != NVML_ALL_LINKS && f->scopeId >= g->nvlink_links)) {
            f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            return;
        }
        feature = F_NVLINK;
        value = f->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX ? g->nvlink_tx_kib
                                                                    : g->nvlink_rx_kib;
        if (f->scopeId != NVML_ALL_LINKS)
            value = value / g->nvlink_links + (f->scopeId == 0 ? value % g->nvlink_links : 0);
        break;
    default:
        f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        return;
    }
    if (g->unsupported & feature) {
        f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        return;
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    f->timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
    f->latencyUsec = 0;
    f->valueType = type;
    if (type == NVML_VALUE_TYPE_UNSIGNED_INT)
        f->value.uiVal = (unsigned int)value;
    else
        f->value.ullVal = value;
    f->nvmlReturn = NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count,
                                             nvmlFieldValue_t *values) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_NONE, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (count < 0 || (count > 0 && !values))
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < count; i++)
        field_value(g, &values[i]);
    return unlock_with(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ health counters */

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType,
                                                int counterType, unsigned long long *count) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_ECC, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!count || errorType < NVML_MEMORY_ERROR_TYPE_CORRECTED ||
        errorType > NVML_MEMORY_ERROR_TYPE_UNCORRECTED || counterType < NVML_VOLATILE_ECC ||
        counterType > NVML_AGGREGATE_ECC)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *count = g->ecc[errorType][counterType];
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                              unsigned int *uncRows, unsigned int *isPending,
                                              unsigned int *failureOccurred) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_REMAPPED_ROWS, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *corrRows = g->remapped_correctable;
    *uncRows = g->remapped_uncorrectable;
    *isPending = g->remapped_pending;
    *failureOccurred = g->remapped_failure;
    return unlock_with(NVML_SUCCESS);
}

/* Begin an NVLink call: NOT_SUPPORTED without links, INVALID_ARGUMENT for a link beyond. */
static nvmlReturn_t begin_nvlink(nvmlDevice_t device, unsigned int link, struct fake_gpu **g) {
    nvmlReturn_t rc = begin_device(device, F_NVLINK, g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((*g)->nvlink_links == 0)
        return unlock_with(NVML_ERROR_NOT_SUPPORTED);
    if (link >= (*g)->nvlink_links)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                             int *isActive) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_nvlink(device, link, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!isActive)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *isActive = 1;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link,
                                                    int counter, unsigned long long *value) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_nvlink(device, link, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!value || counter < 0 || counter >= NVML_NVLINK_ERROR_COUNT)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *value = g->nvlink_errors[link][counter];
    return unlock_with(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ processes */

/* NVML's two-call protocol: with too small a buffer (or none), *count gets the number
 * needed and the call returns NVML_ERROR_INSUFFICIENT_SIZE. */
static nvmlReturn_t get_processes(nvmlDevice_t device, unsigned int *count,
                                  nvmlProcessInfo_t *infos) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_PROCESSES, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!count)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    if (g->nprocs == 0) {
        *count = 0;
        return unlock_with(NVML_SUCCESS);
    }
    if (!infos || *count < g->nprocs) {
        *count = g->nprocs;
        return unlock_with(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int i = 0; i < g->nprocs; i++) {
        infos[i].pid = g->procs[i].pid;
        infos[i].usedGpuMemory = g->procs[i].used;
        infos[i].gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
        infos[i].computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
    }
    *count = g->nprocs;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *count,
                                                            nvmlProcessInfo_t *infos) {
    return get_processes(device, count, infos);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                            unsigned int *count,
                                                            nvmlProcessInfo_t *infos) {
    return get_processes(device, count, infos);
}

/* ------------------------------------------------------------------ MIG */

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                         unsigned int *pendingMode) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_MIG, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!currentMode || !pendingMode)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *currentMode = mig_enabled(g) ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    *pendingMode = *currentMode;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    struct fake_gpu *g;
    struct fake_mig *m;
    nvmlReturn_t rc = begin_handle(device, F_NONE, &g, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!isMigDevice)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = m != NULL;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_MIG, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!mig_enabled(g))
        return unlock_with(NVML_ERROR_NOT_SUPPORTED);
    if (!count)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *count = MAX_MIGS;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_MIG, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!mig_enabled(g))
        return unlock_with(NVML_ERROR_NOT_SUPPORTED);
    if (!migDevice || index >= MAX_MIGS)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    if (index >= g->nmigs)
        return unlock_with(NVML_ERROR_NOT_FOUND);
    *migDevice = mig_handle((unsigned int)(g - g_gpus), index);
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                                 nvmlDevice_t *device) {
    struct fake_gpu *g;
    struct fake_mig *m;
    nvmlReturn_t rc = begin_handle(migDevice, F_NONE, &g, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!m || !device)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *device = g;
    return unlock_with(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ events */

static int event_set_valid(nvmlEventSet_t set) {
    for (struct fake_event_set *s = g_event_sets; s; s = s->next)
        if (s == set)
            return 1;
    return 0;
}

static unsigned long long supported_events(const struct fake_gpu *g) {
    return (g->unsupported & F_XID_EVENTS) ? 0 : nvmlEventTypeXidCriticalError;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!set)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    struct fake_event_set *s = calloc(1, sizeof *s);
    if (!s)
        return unlock_with(NVML_ERROR_MEMORY);
    s->next = g_event_sets;
    g_event_sets = s;
    *set = s;
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    nvmlReturn_t rc = begin();
    if (rc != NVML_SUCCESS)
        return rc;
    for (struct fake_event_set **p = &g_event_sets; *p; p = &(*p)->next) {
        if (*p == set) {
            *p = set->next;
            free(set);
            return unlock_with(NVML_SUCCESS);
        }
    }
    return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                     unsigned long long *eventTypes) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_NONE, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!eventTypes)
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = supported_events(g);
    return unlock_with(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set) {
    struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(device, F_NONE, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!event_set_valid(set))
        return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~supported_events(g))
        return unlock_with(NVML_ERROR_NOT_SUPPORTED);
    set->types[g - g_gpus] |= eventTypes;
    return unlock_with(NVML_SUCCESS);
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The pending XID with the lowest sequence number for this set; 0 if none. */
static int next_xid(const struct fake_event_set *set, unsigned int *slot_out,
                    const struct fake_xid **xid_out) {
    int found = 0;
    for (unsigned int slot = 0; slot < g_count; slot++) {
        const struct fake_gpu *g = &g_gpus[slot];
        if (!(set->types[slot] & supported_events(g) & nvmlEventTypeXidCriticalError))
            continue;
        for (unsigned int i = 0; i < g->nxids; i++) {
            const struct fake_xid *x = &g->xids[i];
            if (x->seq <= set->delivered[slot])
                continue;
            if (!found || x->seq < (*xid_out)->seq) {
                *slot_out = slot;
                *xid_out = x;
                found = 1;
            }
        }
    }
    return found;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                        unsigned int timeoutms) {
    long long deadline = now_ns() + (long long)timeoutms * 1000000LL;
    for (;;) {
        nvmlReturn_t rc = begin(); /* re-reads the control file when it changed */
        if (rc != NVML_SUCCESS)
            return rc;
        if (!data || !event_set_valid(set))
            return unlock_with(NVML_ERROR_INVALID_ARGUMENT);
        unsigned int slot;
        const struct fake_xid *xid;
        if (next_xid(set, &slot, &xid)) {
            set->delivered[slot] = xid->seq;
            data->device = &g_gpus[slot];
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = xid->code;
            data->gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
            data->computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
            return unlock_with(NVML_SUCCESS);
        }
        pthread_mutex_unlock(&g_lock);

        long long left = deadline - now_ns();
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        long long step = left < EVENT_POLL_MS * 1000000LL ? left : EVENT_POLL_MS * 1000000LL;
        struct timespec ts = {step / 1000000000LL, step % 1000000000LL};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
    }
}

/* ------------------------------------------------------------------ not NVML */

/* Lets a process tell this fake from the real library: 1 = control-file format 1. */
EXPORT int gpufleet_fake_nvml_format(void) { return 1; }
