/* The C interface of libtensormem_torch.so: every function the library exports, the structs they pass
 * and the status codes they return, as the Rust sources under src/ define them (their docs are the
 * reference). tests/c_abi.rs checks this file against those sources, name for name and type for type:
 * change both together. The C++ layer (tensormem_allocator.cpp) includes it; the Python package ships
 * it beside that source.
 *
 * Types: Rust's `TorchX` structs (and other named types) are `TmX` here; `Option<F>` of a function
 * pointer type is the nullable function pointer `TmF`; a CUDA stream is `cudaStream_t`. */
#ifndef TENSORMEM_ABI_H
#define TENSORMEM_ABI_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes (src/status.rs, and the weights functions' own, src/weights.rs), a pool allocator's answers
 * (src/native/pools.rs) and the size of an NCCL unique id (src/nccl_weights.rs). */
enum {
  TM_OK = 0,
  TM_OUT_OF_MEMORY = 1,
  TM_ERROR = -1,
  TM_UNSUPPORTED = 2,
  TM_WEIGHTS_TIMED_OUT = 3,
  TM_WEIGHTS_CLOSED = 4,
  POOL_ALLOC_OK = 0,
  POOL_ALLOC_OUT_OF_MEMORY = 1,
  POOL_ALLOC_ERROR = -1,
  TM_NCCL_UNIQUE_ID_BYTES = 128
};

/* PyTorch's MempoolId_t, passed by value (src/hooks.rs). */
typedef struct TmMempoolId {
  uint64_t first;
  uint64_t second;
} TmMempoolId;

/* One Stat of PyTorch's DeviceStats (src/native/mod.rs). */
typedef struct TmStat {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
} TmStat;

/* PyTorch's c10::CachingDeviceAllocator::DeviceStats; each array is all, small pool, large pool. */
typedef struct TmDeviceStats {
  TmStat allocation[3];
  TmStat segment[3];
  TmStat active[3];
  TmStat inactive_split[3];
  TmStat allocated_bytes[3];
  TmStat reserved_bytes[3];
  TmStat active_bytes[3];
  TmStat inactive_split_bytes[3];
  TmStat requested_bytes[3];
  int64_t num_alloc_retries;
  int64_t num_ooms;
  TmStat oversize_allocations;
  TmStat oversize_segments;
  int64_t num_sync_all_streams;
  int64_t num_device_alloc;
  int64_t num_device_free;
  int64_t max_split_size;
} TmDeviceStats;

/* One trace entry (src/native/hooks.rs). */
typedef struct TmTraceEntry {
  int action;
  int device;
  uint64_t addr;
  uint64_t size;
  uint64_t stream;
  int64_t time_us;
  uint64_t pool_first;
  uint64_t pool_second;
} TmTraceEntry;

/* One segment of a snapshot, without its blocks (src/native/snapshot.rs). */
typedef struct TmSegmentInfo {
  int64_t device;
  uint64_t address;
  uint64_t total_size;
  uint64_t requested_size;
  uint64_t allocated_size;
  uint64_t active_size;
  uint64_t stream;
  uint8_t is_large;
  uint8_t is_expandable;
  uint64_t pool_first;
  uint64_t pool_second;
  uint64_t block_count;
} TmSegmentInfo;

/* One block of a snapshot's segment. */
typedef struct TmBlockInfo {
  uint64_t size;
  uint64_t requested_size;
  uint8_t allocated;
  uint8_t active;
} TmBlockInfo;

/* The settings reported with a snapshot; the string is owned by the snapshot. */
typedef struct TmConfigInfo {
  double garbage_collection_threshold;
  uint64_t max_split_size;
  uint64_t pinned_num_register_threads;
  uint8_t expandable_segments;
  uint8_t release_lock_on_malloc;
  uint8_t pinned_use_host_register;
  uint8_t graph_capture_record_stream_reuse;
  const char* last_allocator_settings;
  uint64_t roundup_power2_divisions[16];
} TmConfigInfo;

/* Opaque: a snapshot, a pool's checkpoint. */
typedef struct TmSnapshot TmSnapshot;
typedef struct TmPoolCheckpoint TmPoolCheckpoint;

/* Functions the C++ layer hands the library (src/native/hooks.rs, src/native/pools.rs). */
typedef void (*TmTraceFn)(const TmTraceEntry* entry);
typedef void (*TmOomFn)(int device, uint64_t size, uint64_t total, uint64_t free);
typedef int (*TmFreeMemoryFn)(void);
typedef int (*TmFilterFn)(void* context, cudaStream_t stream);
typedef void (*TmDropFn)(void* context);
typedef int (*TmPoolMallocFn)(void* context, size_t size, void** out);
typedef int (*TmPoolFreeFn)(void* context, void* ptr, size_t size);
typedef void (*TmPointerFn)(void* context, void* ptr);

/* Errors (src/error.rs). */
const char* tensormem_last_error(void);
int tensormem_last_error_code(void);
void tensormem_clear_last_error(void);

/* PyTorch's CUDAPluggableAllocator (src/allocate.rs, src/hooks.rs). */
void* tensormem_alloc(size_t size, int device, cudaStream_t stream);
void tensormem_free(void* ptr, size_t size, int device, cudaStream_t stream);
void tensormem_record_stream(void* ptr, cudaStream_t stream);
void* tensormem_base_alloc(void* ptr, size_t* size);
void tensormem_init(int device_count);
void tensormem_empty_cache(void);
void tensormem_set_memory_fraction(double fraction, int device);
void tensormem_begin_allocate_to_pool(int device, TmMempoolId pool, void* filter);
void tensormem_end_allocate_to_pool(int device, TmMempoolId pool);
void tensormem_release_pool(int device, TmMempoolId pool);

/* Statistics and snapshots for Python (src/stats.rs). */
char* tensormem_memory_stats_json(int device);
void tensormem_string_free(char* text);
int tensormem_reset_peak_stats(int device);
int tensormem_dump_snapshot(const char* path);
int tensormem_record_history(int enabled, size_t max_entries);

/* The C++ layer's CUDAAllocator (src/native/mod.rs). */
int tensormem_malloc(size_t size, int device, cudaStream_t stream, void** out);
int tensormem_raw_delete(void* ptr);
int tensormem_record_stream_checked(void* ptr, int device, cudaStream_t stream);
int tensormem_device_stats(int device, TmDeviceStats* out, size_t size);
int tensormem_reset_accumulated_stats(int device);
int tensormem_empty_cache_pool(uint64_t first, uint64_t second);
int tensormem_cache_info(int device, size_t* largest);
int tensormem_get_memory_fraction(int device, double* fraction);
int tensormem_set_memory_fraction_checked(double fraction, int device);
int tensormem_usage(int device, int64_t* allocated, int64_t* reserved);
int tensormem_set_allocator_settings(const char* config);
int tensormem_backend_supports(const char* method);
const char* tensormem_allocator_name(void);
int tensormem_pool_peer_access(int device, int peer);

/* Hooks into the C++ layer (src/native/hooks.rs). */
int tensormem_attach_trace_tracker(TmTraceFn f);
int tensormem_set_oom_observer(TmOomFn f);
int tensormem_set_free_memory_hook(TmFreeMemoryFn f);

/* Private pools (src/native/pools.rs). */
int tensormem_pool_begin(int device, uint64_t first, uint64_t second, TmFilterFn filter, TmDropFn drop,
                         void* context);
int tensormem_pool_end_on(int device, uint64_t first, uint64_t second, cudaStream_t stream);
int tensormem_pool_end(int device, uint64_t first, uint64_t second);
int tensormem_pool_release(int device, uint64_t first, uint64_t second);
int tensormem_pool_create_or_incref(int device, uint64_t first, uint64_t second);
int tensormem_pool_create_with_allocator(int device, uint64_t first, uint64_t second, TmPoolMallocFn malloc,
                                         TmPoolFreeFn free, TmDropFn drop, void* context);
int tensormem_pool_set_use_on_oom(int device, uint64_t first, uint64_t second, int use_on_oom);
int tensormem_pool_set_no_split(int device, uint64_t first, uint64_t second);
int64_t tensormem_pool_use_count(int device, uint64_t first, uint64_t second);
int tensormem_pool_check_live(int device, uint64_t first, uint64_t second, void* const* ptrs, size_t count);
TmPoolCheckpoint* tensormem_pool_checkpoint(int device, uint64_t first, uint64_t second);
void tensormem_checkpoint_free(TmPoolCheckpoint* checkpoint);
int tensormem_pool_restore(int device, const TmPoolCheckpoint* checkpoint, TmPointerFn freed,
                           TmPointerFn allocated, void* context);

/* Pools that sleep and wake (src/native/sleep.rs). */
int tensormem_pool_sleep(int device, uint64_t first, uint64_t second, int keep_contents, uint64_t* released);
int tensormem_pool_wake(int device, uint64_t first, uint64_t second, uint64_t* mapped);
int tensormem_pool_is_asleep(int device, uint64_t first, uint64_t second);
int tensormem_host_empty_cache(void);
int tensormem_host_reserve(int device, uint64_t bytes, uint64_t* reserved);

/* Snapshots and history for the C++ layer (src/native/snapshot.rs). */
TmSnapshot* tensormem_snapshot_take(uint64_t first, uint64_t second, int include_traces);
uint64_t tensormem_snapshot_segment_count(const TmSnapshot* snapshot);
int tensormem_snapshot_segment(const TmSnapshot* snapshot, uint64_t index, TmSegmentInfo* out, size_t size);
int tensormem_snapshot_block(const TmSnapshot* snapshot, uint64_t segment, uint64_t block, TmBlockInfo* out,
                             size_t size);
uint64_t tensormem_snapshot_trace_count(const TmSnapshot* snapshot, int device);
int tensormem_snapshot_trace_devices(const TmSnapshot* snapshot);
int tensormem_snapshot_trace(const TmSnapshot* snapshot, int device, uint64_t index, TmTraceEntry* out,
                             size_t size);
int tensormem_snapshot_config(const TmSnapshot* snapshot, TmConfigInfo* out, size_t size);
void tensormem_snapshot_free(TmSnapshot* snapshot);
int tensormem_history(int enabled, size_t max_entries);
int tensormem_history_enabled(void);

/* CUDA IPC (src/native/ipc.rs). */
int tensormem_ipc_share(void* ptr, uint8_t* out, size_t capacity, size_t* len, ptrdiff_t* offset);
int tensormem_ipc_open(const uint8_t* handle, size_t len, int device, void** out);
int tensormem_ipc_close(void* ptr);

/* Weights from a producer process into a consumer's own tensors (src/weights.rs). Publishers and subscriptions
 * are opaque handles; tensors are parallel arrays (names, first-element addresses, PyTorch dtype names, dimension
 * counts, then all sizes and all strides in elements, one tensor after another). A timeout below 0 waits without
 * limit. */
int tensormem_weights_publish(int device, size_t count, const char* const* names, const uint64_t* ptrs,
                              const char* const* dtypes, const uint64_t* ndims, const uint64_t* shapes,
                              const uint64_t* strides, void** out);
int tensormem_weights_message(void* publisher, uint8_t* out, size_t capacity, size_t* len);
int tensormem_weights_announce(void* publisher, cudaStream_t stream, uint64_t* version);
int tensormem_weights_wait_installed(void* publisher, uint64_t version, int64_t timeout_ms);
int tensormem_weights_holders(void* publisher, size_t* count);
int tensormem_weights_release(void* publisher, int64_t timeout_ms);
int tensormem_weights_drop_publisher(void* publisher);
int tensormem_weights_open(const uint8_t* bytes, size_t len, cudaStream_t stream, void** out);
int tensormem_weights_sources(void* subscription, size_t capacity, uint64_t* ptrs, size_t* count);
int tensormem_weights_prepare(void* subscription, size_t count, const char* const* names, const uint64_t* ptrs,
                              const char* const* dtypes, const uint64_t* ndims, const uint64_t* shapes,
                              const uint64_t* strides, int allow_unused, uint64_t* plan, size_t* copies);
int tensormem_weights_install(void* subscription, uint64_t plan, cudaStream_t stream, int64_t timeout_ms,
                              uint64_t* version);
int tensormem_weights_begin(void* subscription, cudaStream_t stream, int64_t timeout_ms, uint64_t* version);
int tensormem_weights_finish(void* subscription, uint64_t version);
int tensormem_weights_close_subscription(void* subscription);

/* Weights from one rank into the other ranks' own tensors through NCCL (src/nccl_weights.rs). A sync is an
 * opaque handle; tensors are parallel arrays (names, first-byte addresses, sizes in bytes, metadata text such as
 * "float32[768,3072]" that every rank gives alike). NCCL is loaded on first use. */
typedef struct TmNcclSyncReport {
  uint64_t sync;
  uint64_t bytes;
  uint64_t buckets;
  uint64_t direct;
  double seconds;
} TmNcclSyncReport;

int tensormem_nccl_unique_id(uint8_t* out, size_t len);
int tensormem_nccl_weights_open(int device, const uint8_t* unique_id, size_t unique_id_len, int rank, int world_size,
                                int src, size_t count, const char* const* names, const uint64_t* ptrs,
                                const uint64_t* sizes, const char* const* metas, size_t bucket_bytes,
                                uint64_t timeout_ms, void** out);
int tensormem_nccl_weights_sync(void* sync, cudaStream_t stream, TmNcclSyncReport* report);
int tensormem_nccl_weights_close(void* sync);

#ifdef __cplusplus
}
#endif

#endif /* TENSORMEM_ABI_H */
