// PyTorch's CUDA caching allocator interface (c10::cuda::CUDACachingAllocator::CUDAAllocator) on
// tensormem. Built by the Python package tensormem_torch against the installed PyTorch; every method
// converts types, calls one C function of libtensormem_torch.so (src/native/ in the crate, declared in
// tensormem_abi.h beside this file) and turns a failure into PyTorch's exception. No allocation policy
// lives here.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <atomic>
#include <cstring>
#include <deque>
#include <unordered_map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensormem_abi.h"

// The trace tracker hands this struct over with no size to check: keep it in step with Rust's
// `TorchTraceEntry` (whose test asserts the same size; tests/c_abi.rs checks the fields).
static_assert(sizeof(TmTraceEntry) == 56, "TmTraceEntry must match tensormem's TorchTraceEntry");

namespace {

namespace CCA = c10::cuda::CUDACachingAllocator;
namespace CDA = c10::CachingDeviceAllocator;

std::string last_error() {
  const char* message = tensormem_last_error();
  return message ? std::string(message) : std::string("(no message)");
}

// Raises PyTorch's exception for the library's last error on this thread, met by the call behind
// `what`: torch.OutOfMemoryError, PyTorch's own refusal for the backend as PyTorch words it, or a
// RuntimeError naming the call.
[[noreturn]] void raise_last(const char* what) {
  switch (tensormem_last_error_code()) {
    case TM_OUT_OF_MEMORY:
      TORCH_CHECK_WITH(OutOfMemoryError, false, last_error());
    case TM_UNSUPPORTED:
      TORCH_CHECK(false, last_error());
    default:
      TORCH_CHECK(false, "tensormem: ", what, " failed: ", last_error());
  }
}

// Raises PyTorch's exception for a failed call (a status code other than TM_OK).
void check(int rc, const char* what) {
  if (rc != TM_OK) raise_last(what);
}

// PyTorch's Python stacks for snapshots (`_record_memory_history(context=...)`): the stacks are
// PyTorch's own objects (its context recorder makes them), so they are kept here, beside the library's
// trace, and attached to blocks and trace entries when a snapshot is converted.
struct StackRecord {
  CDA::TraceEntry::Action action;
  void* ptr;
  std::shared_ptr<c10::GatheredContext> context;
};

struct Stacks {
  std::mutex mutex;
  CCA::CreateContextFn recorder = nullptr;
  CCA::RecordContext when = CCA::RecordContext::NEVER;
  size_t max_entries = 0;
  std::unordered_map<void*, std::shared_ptr<c10::GatheredContext>> live;
  std::deque<StackRecord> trace;
  // Whether stacks are recorded: the allocation path reads only this.
  std::atomic<bool> recording{false};

  bool on() const { return recording.load(std::memory_order_relaxed); }

  void push(StackRecord record) {
    trace.push_back(std::move(record));
    while (trace.size() > max_entries) trace.pop_front();
  }

  void allocated(void* ptr) {
    CCA::CreateContextFn make;
    {
      std::lock_guard<std::mutex> lock(mutex);
      make = recorder;
    }
    if (make == nullptr || ptr == nullptr) return;
    auto context = make();  // outside the lock: it may take the GIL
    std::lock_guard<std::mutex> lock(mutex);
    live[ptr] = context;
    if (when >= CCA::RecordContext::ALLOC) push({CDA::TraceEntry::ALLOC, ptr, context});
  }

  void freed(void* ptr) {
    CCA::CreateContextFn make;
    {
      std::lock_guard<std::mutex> lock(mutex);
      make = when == CCA::RecordContext::ALL ? recorder : nullptr;
    }
    std::shared_ptr<c10::GatheredContext> at_free = make ? make() : nullptr;
    std::lock_guard<std::mutex> lock(mutex);
    auto it = live.find(ptr);
    std::shared_ptr<c10::GatheredContext> at_alloc;
    if (it != live.end()) {
      at_alloc = std::move(it->second);
      live.erase(it);
    }
    if (when >= CCA::RecordContext::ALLOC) {
      push({CDA::TraceEntry::FREE_REQUESTED, ptr, at_free ? at_free : at_alloc});
    }
  }

  void configure(bool enabled, CCA::CreateContextFn make, size_t entries, CCA::RecordContext level,
                 bool clear) {
    std::lock_guard<std::mutex> lock(mutex);
    recorder = enabled ? make : nullptr;
    when = enabled ? level : CCA::RecordContext::NEVER;
    max_entries = entries;
    if (!enabled) live.clear();
    if (!enabled || clear) trace.clear();
    recording.store(recorder != nullptr && when != CCA::RecordContext::NEVER,
                    std::memory_order_relaxed);
  }

  std::shared_ptr<c10::GatheredContext> of_live(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = live.find(ptr);
    return it == live.end() ? nullptr : it->second;
  }

  // Gives each alloc / free-requested entry of `entries` (in order) the stack recorded for it.
  void attach(std::vector<CDA::TraceEntry>& entries) {
    std::lock_guard<std::mutex> lock(mutex);
    size_t cursor = 0;
    for (auto& entry : entries) {
      if (entry.action_ != CDA::TraceEntry::ALLOC &&
          entry.action_ != CDA::TraceEntry::FREE_REQUESTED) {
        continue;
      }
      for (size_t k = cursor; k < trace.size(); ++k) {
        if (trace[k].action == entry.action_ &&
            reinterpret_cast<size_t>(trace[k].ptr) == entry.addr_) {
          entry.context_ = trace[k].context;
          cursor = k + 1;
          break;
        }
      }
    }
  }
};

Stacks stacks;

void delete_ptr(void* ptr) {
  if (ptr != nullptr && stacks.on()) stacks.freed(ptr);
  // A deleter cannot throw: PyTorch calls it from destructors.
  if (tensormem_raw_delete(ptr) != TM_OK) {
    std::fprintf(stderr, "tensormem: freeing %p failed: %s\n", ptr, last_error().c_str());
  }
}

CDA::Stat stat(const TmStat& s) {
  CDA::Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

void stat_array(CDA::StatArray& out, const TmStat (&in)[3]) {
  for (size_t i = 0; i < 3; ++i) out[i] = stat(in[i]);
}

std::mutex hooks_mutex;
std::vector<CCA::OutOfMemoryObserver> oom_observers;
std::vector<CCA::AllocatorTraceTracker> trace_trackers;

void oom_fanout(int device, uint64_t size, uint64_t total, uint64_t free_bytes) {
  std::vector<CCA::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(hooks_mutex);
    observers = oom_observers;
  }
  for (auto& observer : observers) observer(device, size, total, free_bytes);
}

CDA::TraceEntry::Action action_of(int action) {
  return static_cast<CDA::TraceEntry::Action>(action);
}

void trace_fanout(const TmTraceEntry* e) {
  CDA::TraceEntry entry(action_of(e->action), static_cast<c10::DeviceIndex>(e->device), e->addr,
                        e->size, reinterpret_cast<void*>(e->stream),
                        c10::MempoolId_t{e->pool_first, e->pool_second}, 0);
  entry.time_.t_ = static_cast<time_t>(e->time_us);
  std::lock_guard<std::mutex> lock(hooks_mutex);
  for (auto& tracker : trace_trackers) tracker(entry);
}

int run_free_memory_callbacks() {
  bool freed = false;
  for (const auto& name : c10::FreeCudaMemoryCallbacksRegistry()->Keys()) {
    freed |= c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
  }
  return freed ? 1 : 0;
}

using Filter = std::function<bool(cudaStream_t)>;

int call_filter(void* context, cudaStream_t stream) {
  return (*static_cast<Filter*>(context))(stream) ? 1 : 0;
}

void drop_filter(void* context) { delete static_cast<Filter*>(context); }

// The allocator of a MemPool(allocator=...): the library calls it for the pool's segments, as
// PyTorch's allocator calls `raw_alloc` and `raw_delete` (null from `raw_alloc`: out of memory).
// Nothing may escape into the library: an exception becomes a status code and a warning.
using PoolAllocatorPtr = std::shared_ptr<CCA::CUDAAllocator>;

int pool_malloc(void* context, size_t size, void** out) {
  try {
    *out = (*static_cast<PoolAllocatorPtr*>(context))->raw_alloc(size);
    return *out ? POOL_ALLOC_OK : POOL_ALLOC_OUT_OF_MEMORY;
  } catch (const c10::OutOfMemoryError&) {
    *out = nullptr;
    return POOL_ALLOC_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    *out = nullptr;
    TORCH_WARN("tensormem: the MemPool's allocator raised in raw_alloc(", size, "): ", e.what());
    return POOL_ALLOC_ERROR;
  } catch (...) {
    *out = nullptr;
    TORCH_WARN("tensormem: the MemPool's allocator raised in raw_alloc(", size, ")");
    return POOL_ALLOC_ERROR;
  }
}

int pool_free(void* context, void* ptr, size_t) {
  try {
    (*static_cast<PoolAllocatorPtr*>(context))->raw_delete(ptr);
    return POOL_ALLOC_OK;
  } catch (const std::exception& e) {
    TORCH_WARN("tensormem: the MemPool's allocator raised in raw_delete(", ptr, "): ", e.what());
    return POOL_ALLOC_ERROR;
  } catch (...) {
    TORCH_WARN("tensormem: the MemPool's allocator raised in raw_delete(", ptr, ")");
    return POOL_ALLOC_ERROR;
  }
}

void drop_pool_allocator(void* context) { delete static_cast<PoolAllocatorPtr*>(context); }

struct CheckpointState : CCA::AllocatorState {
  explicit CheckpointState(TmPoolCheckpoint* c) : checkpoint(c) {}
  ~CheckpointState() override { tensormem_checkpoint_free(checkpoint); }
  TmPoolCheckpoint* checkpoint;
};

struct Restore {
  CCA::CheckpointDelta delta;
  c10::DeviceIndex device;
};

void restored_freed(void* context, void* ptr) {
  static_cast<Restore*>(context)->delta.ptrs_freed.push_back(ptr);
}

void restored_allocated(void* context, void* ptr) {
  auto* restore = static_cast<Restore*>(context);
  restore->delta.dataptrs_allocd.emplace_back(
      ptr, ptr, &delete_ptr, c10::Device(c10::DeviceType::CUDA, restore->device));
}

class TensormemAllocator final : public CCA::CUDAAllocator {
 public:
  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    void* ptr = nullptr;
    if (size != 0) {
      cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
      check(tensormem_malloc(size, device, stream, &ptr), "allocate");
      if (stacks.on()) stacks.allocated(ptr);
    }
    return {ptr, ptr, &delete_ptr, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_ptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void* raw_alloc(size_t nbytes) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    void* ptr = nullptr;
    check(tensormem_malloc(nbytes, c10::cuda::current_device(), stream, &ptr), "raw_alloc");
    if (stacks.on()) stacks.allocated(ptr);
    return ptr;
  }

  void raw_delete(void* ptr) override {
    if (ptr != nullptr && stacks.on()) stacks.freed(ptr);
    check(tensormem_raw_delete(ptr), "raw_delete");
  }

  void init(int device_count) override {
    tensormem_init(device_count);
    initialized_ = true;
  }

  bool initialized() override { return initialized_; }

  double getMemoryFraction(c10::DeviceIndex device) override {
    double fraction = 1.0;
    check(tensormem_get_memory_fraction(device, &fraction), "getMemoryFraction");
    return fraction;
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check(tensormem_set_memory_fraction_checked(fraction, device), "setMemoryFraction");
  }

  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex device) override {
    check(tensormem_backend_supports("getExpandableSegmentSizes"), "getExpandableSegmentSizes");
    std::vector<CCA::StreamSegmentSize> sizes;
    for_each_segment({0, 0}, [&](const TmSegmentInfo& s, TmSnapshot*, uint64_t) {
      if (s.is_expandable && s.device == device) {
        sizes.emplace_back(reinterpret_cast<cudaStream_t>(s.stream), !s.is_large, s.total_size);
      }
    });
    return sizes;
  }

  void emptyCache(c10::MempoolId_t mempool_id) override {
    check(tensormem_empty_cache_pool(mempool_id.first, mempool_id.second), "emptyCache");
  }

  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    check(tensormem_cache_info(device, largestBlock), "cacheInfo");
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    void* base = tensormem_base_alloc(ptr, size);
    if (base == nullptr) raise_last("getBaseAllocation");
    return base;
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get() || ptr.get_deleter() != &delete_ptr) return;
    check(tensormem_record_stream_checked(ptr.get(), ptr.device().index(), stream.stream()),
          "recordStream");
  }

  CDA::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    TmDeviceStats s{};
    check(tensormem_device_stats(device, &s, sizeof s), "getDeviceStats");
    CDA::DeviceStats out;
    stat_array(out.allocation, s.allocation);
    stat_array(out.segment, s.segment);
    stat_array(out.active, s.active);
    stat_array(out.inactive_split, s.inactive_split);
    stat_array(out.allocated_bytes, s.allocated_bytes);
    stat_array(out.reserved_bytes, s.reserved_bytes);
    stat_array(out.active_bytes, s.active_bytes);
    stat_array(out.inactive_split_bytes, s.inactive_split_bytes);
    stat_array(out.requested_bytes, s.requested_bytes);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.oversize_allocations = stat(s.oversize_allocations);
    out.oversize_segments = stat(s.oversize_segments);
    out.num_sync_all_streams = s.num_sync_all_streams;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    out.max_split_size = s.max_split_size;
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(tensormem_reset_accumulated_stats(device), "resetAccumulatedStats");
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check(tensormem_reset_peak_stats(device) == 0 ? TM_OK : TM_ERROR, "resetPeakStats");
  }

  CCA::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override {
    CCA::SnapshotInfo info;
    TmSnapshot* snap = take(mempool_id, include_traces);
    std::unique_ptr<TmSnapshot, void (*)(TmSnapshot*)> owned(snap, &tensormem_snapshot_free);
    uint64_t segments = tensormem_snapshot_segment_count(snap);
    for (uint64_t i = 0; i < segments; ++i) {
      TmSegmentInfo s{};
      check(tensormem_snapshot_segment(snap, i, &s, sizeof s), "snapshot");
      info.segments.push_back(segment_info(snap, i, s));
    }
    int devices = tensormem_snapshot_trace_devices(snap);
    info.device_traces.resize(devices);
    for (int d = 0; d < devices; ++d) {
      uint64_t count = tensormem_snapshot_trace_count(snap, d);
      auto& trace = info.device_traces[d];
      trace.reserve(count);
      for (uint64_t k = 0; k < count; ++k) {
        TmTraceEntry e{};
        check(tensormem_snapshot_trace(snap, d, k, &e, sizeof e), "snapshot");
        trace.emplace_back(action_of(e.action), static_cast<c10::DeviceIndex>(e.device), e.addr,
                           e.size, reinterpret_cast<void*>(e.stream),
                           c10::MempoolId_t{e.pool_first, e.pool_second}, 0);
        trace.back().time_.t_ = static_cast<time_t>(e.time_us);
      }
      stacks.attach(trace);
    }
    TmConfigInfo c{};
    check(tensormem_snapshot_config(snap, &c, sizeof c), "snapshot");
    auto& m = info.config_metadata;
    m.garbage_collection_threshold = c.garbage_collection_threshold;
    m.max_split_size = c.max_split_size;
    m.pinned_num_register_threads = c.pinned_num_register_threads;
    m.expandable_segments = c.expandable_segments != 0;
    m.release_lock_on_malloc = c.release_lock_on_malloc != 0;
    m.pinned_use_host_register = c.pinned_use_host_register != 0;
    m.graph_capture_record_stream_reuse = c.graph_capture_record_stream_reuse != 0;
    m.last_allocator_settings = c.last_allocator_settings ? c.last_allocator_settings : "";
    m.roundup_power2_divisions.assign(std::begin(c.roundup_power2_divisions),
                                      std::end(c.roundup_power2_divisions));
    return info;
  }

  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    auto* context = new Filter(std::move(filter));
    // The library owns the context from here on, and destroys it on failure too.
    check(tensormem_pool_begin(device, mempool_id.first, mempool_id.second, &call_filter,
                               &drop_filter, context),
          "beginAllocateToPool");
  }

  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    // The capture stream: the device's current stream, as PyTorch's cudaMallocAsync backend has it.
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    check(tensormem_pool_end_on(device, mempool_id.first, mempool_id.second, stream),
          "endAllocateToPool");
  }

  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    check(tensormem_pool_release(device, mempool_id.first, mempool_id.second), "releasePool");
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    int64_t count = tensormem_pool_use_count(device, mempool_id.first, mempool_id.second);
    if (count < 0) raise_last("getPoolUseCount");
    return static_cast<int>(count);
  }

  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    if (allocator == nullptr) {
      check(tensormem_pool_create_or_incref(device, mempool_id.first, mempool_id.second),
            "createOrIncrefPool");
      return;
    }
    // The pool's segments come from `allocator` (a CUDAPluggableAllocator, say). The library owns
    // the context from here on, and destroys it on failure too.
    auto* context = new PoolAllocatorPtr(std::move(allocator));
    check(tensormem_pool_create_with_allocator(device, mempool_id.first, mempool_id.second,
                                               &pool_malloc, &pool_free, &drop_pool_allocator,
                                               context),
          "createOrIncrefPool");
  }

  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override {
    check(tensormem_pool_set_use_on_oom(device, mempool_id.first, mempool_id.second,
                                        use_on_oom ? 1 : 0),
          "setUseOnOOM");
  }

  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    check(tensormem_pool_set_no_split(device, mempool_id.first, mempool_id.second), "setNoSplit");
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    std::vector<void*> ptrs(expected.begin(), expected.end());
    int rc = tensormem_pool_check_live(device, mempool_id.first, mempool_id.second, ptrs.data(),
                                       ptrs.size());
    if (rc < 0) raise_last("checkPoolLiveAllocations");
    return rc == 1;
  }

  // PyTorch's handle: 66 bytes for memory of a device allocation ('c'), 26 + 4 per chunk for memory
  // of an expandable segment ('e'). The library says how long it is; a longer one is asked for again.
  CCA::ShareableHandle shareIpcHandle(void* ptr) override {
    std::string bytes(256, '\0');
    size_t len = 0;
    ptrdiff_t offset = 0;
    check(tensormem_ipc_share(ptr, reinterpret_cast<uint8_t*>(bytes.data()), bytes.size(), &len,
                              &offset),
          "shareIpcHandle");
    if (len > bytes.size()) {
      bytes.assign(len, '\0');
      check(tensormem_ipc_share(ptr, reinterpret_cast<uint8_t*>(bytes.data()), bytes.size(), &len,
                                &offset),
            "shareIpcHandle");
      TORCH_CHECK(len <= bytes.size(), "tensormem: shareIpcHandle: the handle of ", ptr,
                  " grew from ", bytes.size(), " to ", len, " bytes between two calls");
    }
    bytes.resize(len);
    return {offset, std::move(bytes)};
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    void* ptr = nullptr;
    check(tensormem_ipc_open(reinterpret_cast<const uint8_t*>(handle.data()), handle.size(),
                             c10::cuda::current_device(), &ptr),
          "getIpcDevPtr");
    return std::shared_ptr<void>(ptr, [](void* p) {
      if (tensormem_ipc_close(p) != TM_OK) {
        std::fprintf(stderr, "tensormem: closing IPC memory %p failed: %s\n", p,
                     last_error().c_str());
      }
    });
  }

  bool isHistoryEnabled() override {
    check(tensormem_backend_supports("isHistoryEnabled"), "isHistoryEnabled");
    return tensormem_history_enabled() != 0;
  }

  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when, bool clear_history,
                     const std::vector<std::string>&) override {
    check(tensormem_history(enabled ? 1 : 0, alloc_trace_max_entries), "recordHistory");
    stacks.configure(enabled, context_recorder, alloc_trace_max_entries, when, clear_history);
  }

  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    check(tensormem_backend_supports("attachOutOfMemoryObserver"), "attachOutOfMemoryObserver");
    std::lock_guard<std::mutex> lock(hooks_mutex);
    oom_observers.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override {
    check(tensormem_attach_trace_tracker(&trace_fanout), "attachAllocatorTraceTracker");
    std::lock_guard<std::mutex> lock(hooks_mutex);
    trace_trackers.push_back(std::move(tracker));
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    // Memory pools are not covered by context peer access (backend:cudaMallocAsync's memory).
    check(tensormem_pool_peer_access(dev, dev_to_access), "enablePeerAccess");
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(err);
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::MempoolId_t id) override {
    TmPoolCheckpoint* checkpoint = tensormem_pool_checkpoint(device, id.first, id.second);
    if (checkpoint == nullptr) raise_last("getCheckpointState");
    return std::make_shared<CheckpointState>(checkpoint);
  }

  CCA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<CCA::AllocatorState> pps) override {
    auto state = std::dynamic_pointer_cast<CheckpointState>(pps);
    TORCH_CHECK(state != nullptr,
                "tensormem: setCheckpointPoolState was given a state tensormem did not make");
    Restore restore{{}, device};
    check(tensormem_pool_restore(device, state->checkpoint, &restored_freed, &restored_allocated,
                                 &restore),
          "setCheckpointPoolState");
    return std::move(restore.delta);
  }

  std::string name() override { return tensormem_allocator_name(); }

 private:
  TmSnapshot* take(c10::MempoolId_t mempool_id, bool include_traces) {
    TmSnapshot* snap =
        tensormem_snapshot_take(mempool_id.first, mempool_id.second, include_traces ? 1 : 0);
    if (snap == nullptr) raise_last("snapshot");
    return snap;
  }

  template <typename F>
  void for_each_segment(c10::MempoolId_t pool, F f) {
    TmSnapshot* snap = take(pool, false);
    std::unique_ptr<TmSnapshot, void (*)(TmSnapshot*)> owned(snap, &tensormem_snapshot_free);
    uint64_t segments = tensormem_snapshot_segment_count(snap);
    for (uint64_t i = 0; i < segments; ++i) {
      TmSegmentInfo s{};
      check(tensormem_snapshot_segment(snap, i, &s, sizeof s), "snapshot");
      f(s, snap, i);
    }
  }

  CDA::SegmentInfo segment_info(TmSnapshot* snap, uint64_t index, const TmSegmentInfo& s) {
    CDA::SegmentInfo out;
    out.device = static_cast<c10::DeviceIndex>(s.device);
    out.address = s.address;
    out.total_size = s.total_size;
    out.requested_size = s.requested_size;
    out.allocated_size = s.allocated_size;
    out.active_size = s.active_size;
    out.stream = reinterpret_cast<void*>(s.stream);
    out.is_large = s.is_large != 0;
    out.is_expandable = s.is_expandable != 0;
    out.owner_private_pool_id = {s.pool_first, s.pool_second};
    out.blocks.reserve(s.block_count);
    uint64_t address = s.address;
    for (uint64_t j = 0; j < s.block_count; ++j) {
      TmBlockInfo b{};
      check(tensormem_snapshot_block(snap, index, j, &b, sizeof b), "snapshot");
      CDA::BlockInfo block;
      block.size = b.size;
      block.requested_size = b.requested_size;
      block.allocated = b.allocated != 0;
      block.active = b.active != 0;
      if (block.allocated) {
        block.context_when_allocated = stacks.of_live(reinterpret_cast<void*>(address));
      }
      address += b.size;
      out.blocks.push_back(std::move(block));
    }
    return out;
  }

  bool initialized_ = false;
  bool enabled_ = true;
};

}  // namespace

// Makes tensormem PyTorch's CUDA allocator. Returns 0, or -1 with the reason in `error` (at most
// `error_len` bytes, NUL-terminated). Call before the first CUDA allocation.
extern "C" int tensormem_torch_install(char* error, size_t error_len) {
  try {
    static std::shared_ptr<TensormemAllocator> instance = std::make_shared<TensormemAllocator>();
    check(tensormem_set_oom_observer(&oom_fanout), "attachOutOfMemoryObserver");
    check(tensormem_set_free_memory_hook(&run_free_memory_callbacks), "free-memory callbacks");
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(instance);
    return 0;
  } catch (const std::exception& e) {
    if (error != nullptr && error_len > 0) {
      std::snprintf(error, error_len, "%s", e.what());
    }
    return -1;
  }
}
