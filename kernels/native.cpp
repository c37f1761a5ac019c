// sdpatch's native launch path: replays a recorded sequence of allocations and Triton kernel
// launches for one input layout, in one call from Python.
//
// Per call, an attention backward at 77 keys or at head dim 160 spends longer on the host than its
// kernels run: each launch through Triton's Python-facing launcher and each Python-side allocation
// costs microseconds (docs/benchmarks.md, v9). Here a layout's whole sequence (allocate, launch,
// allocate, launch, ...) is one C++ call: the launches go straight to the CUDA driver with argument
// cells packed once, when the program was recorded (native.py).
//
// A launch may take TMA descriptors (CUtensorMap, passed by value): each call encodes them afresh for
// its tensors' addresses, with the dims, strides and box fixed at recording.
//
// No CUDA headers and no link against libcuda: the driver functions are looked up in the libcuda.so.1
// that torch and Triton have loaded, so the module also builds (and its layout matching runs) without CUDA.

#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>
#include <dlfcn.h>

#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <vector>

namespace {

using CuLaunchKernel = int (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                               unsigned block_y, unsigned block_z, unsigned shared_bytes, void* stream, void** params,
                               void** extra);

// cuTensorMapEncodeTiled; the enums (data type, interleave, swizzle, L2 promotion, OOB fill) as ints.
using CuTensorMapEncodeTiled = int (*)(void* tensor_map, int dtype, uint32_t rank, void* address, const uint64_t* dims,
                                       const uint64_t* strides, const uint32_t* box, const uint32_t* element_strides,
                                       int interleave, int swizzle, int l2_promotion, int oob_fill);

template <typename F>
F driver_function(const char* name) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  TORCH_CHECK(lib != nullptr, "sdpatch native: libcuda.so.1 is not loaded in this process");
  auto f = reinterpret_cast<F>(dlsym(lib, name));
  TORCH_CHECK(f != nullptr, "sdpatch native: libcuda.so.1 has no ", name);
  return f;
}

CuLaunchKernel cu_launch_kernel() {
  static const CuLaunchKernel fn = driver_function<CuLaunchKernel>("cuLaunchKernel");
  return fn;
}

CuTensorMapEncodeTiled cu_tensor_map_encode_tiled() {
  static const CuTensorMapEncodeTiled fn = driver_function<CuTensorMapEncodeTiled>("cuTensorMapEncodeTiled");
  return fn;
}

constexpr int kL2Promotion128B = 2;  // CU_TENSOR_MAP_L2_PROMOTION_L2_128B, as Triton's launcher encodes

struct alignas(64) TensorMap {  // CUtensorMap: 128 opaque bytes, 64-byte aligned
  uint64_t opaque[16];
};

// A TMA descriptor parameter: cuTensorMapEncodeTiled's arguments but the address, innermost dim first.
struct TensorMapSpec {
  int param;  // the parameter it is passed as
  int slot;   // the tensor whose data pointer is the global address
  int dtype, swizzle, oob_fill;
  std::vector<uint64_t> dims, strides;  // strides in bytes, one fewer than dims
  std::vector<uint32_t> box;
};

// A tensor the program allocates: laid out exactly as the recorded one was.
struct Buffer {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

struct Launch {
  uint64_t function;          // CUfunction, loaded by Triton on the program's device
  unsigned grid[3];
  unsigned threads;           // 32 * num_warps
  unsigned shared_bytes;
  std::vector<uint64_t> cells;                  // one 8-byte cell per kernel parameter, scalars packed
  std::vector<std::pair<int, int>> pointers;    // (parameter, slot): cells filled with data pointers per call
  std::vector<int> allocate_first;              // buffer slots allocated just before this launch
  std::vector<TensorMapSpec> maps;              // parameters passed as TMA descriptors, encoded per call
};

struct Program {
  std::vector<Buffer> buffers;  // slot n_inputs + i
  std::vector<Launch> launches;
  std::vector<int> outputs;     // slots returned, -1 for None
};

// Everything Triton specialized a kernel on, and the launches' scalars depend on: per input its
// presence, dtype, device, address modulo 16 bytes (the launchers' vector width comes from it),
// sizes and strides; and the caller's options (the softmax scale, flags), bit for bit.
std::vector<int64_t> layout_key(const std::vector<std::optional<at::Tensor>>& inputs, const std::vector<double>& options) {
  std::vector<int64_t> key;
  for (double o : options) {
    int64_t bits;
    std::memcpy(&bits, &o, sizeof bits);
    key.push_back(bits);
  }
  for (const auto& t : inputs) {
    if (!t.has_value() || !t->defined()) {
      key.push_back(-1);
      continue;
    }
    key.push_back(static_cast<int64_t>(t->scalar_type()));
    key.push_back(t->device().index());
    key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16));
    key.push_back(t->dim());
    for (auto s : t->sizes()) key.push_back(s);
    for (auto s : t->strides()) key.push_back(s);
  }
  return key;
}

class Registry {
 public:
  // Programs of one call site, by the layout of their inputs.
  void add(const std::vector<std::optional<at::Tensor>>& inputs, const std::vector<double>& options,
           std::shared_ptr<Program> program) {
    const size_t n_slots = inputs.size() + program->buffers.size();
    for (const auto& launch : program->launches) {
      for (const auto& [param, slot] : launch.pointers) {
        TORCH_CHECK(slot >= 0 && static_cast<size_t>(slot) < n_slots, "pointer to slot ", slot, " of ", n_slots);
        TORCH_CHECK(static_cast<size_t>(slot) >= inputs.size() || (inputs[slot].has_value() && inputs[slot]->defined()),
                    "pointer to input ", slot, ", which is None");
      }
      for (int slot : launch.allocate_first)
        TORCH_CHECK(static_cast<size_t>(slot) >= inputs.size() && static_cast<size_t>(slot) < n_slots,
                    "slot ", slot, " is not a buffer");
      for (const auto& map : launch.maps) {
        TORCH_CHECK(map.slot >= 0 && static_cast<size_t>(map.slot) < n_slots, "descriptor of slot ", map.slot, " of ", n_slots);
        TORCH_CHECK(static_cast<size_t>(map.slot) >= inputs.size() || (inputs[map.slot].has_value() && inputs[map.slot]->defined()),
                    "descriptor of input ", map.slot, ", which is None");
      }
    }
    for (int slot : program->outputs) TORCH_CHECK(slot < static_cast<int>(n_slots), "output slot ", slot, " of ", n_slots);
    programs_[layout_key(inputs, options)] = std::move(program);
  }

  size_t size() const { return programs_.size(); }
  void clear() { programs_.clear(); }

  // The recorded program's outputs for these inputs, or None when no program has their layout.
  py::object run(const std::vector<std::optional<at::Tensor>>& inputs, const std::vector<double>& options,
                 uint64_t stream) const {
    auto found = programs_.find(layout_key(inputs, options));
    if (found == programs_.end()) return py::none();
    // The GIL stays held: released, another Python thread could keep it for a switch interval (5 ms).
    std::vector<at::Tensor> slots = execute(*found->second, inputs, stream);
    py::tuple out(found->second->outputs.size());
    for (size_t i = 0; i < found->second->outputs.size(); ++i) {
      int slot = found->second->outputs[i];
      out[i] = slot < 0 ? py::none() : py::cast(slots[slot]);
    }
    return out;
  }

 private:
  static std::vector<at::Tensor> execute(const Program& p, const std::vector<std::optional<at::Tensor>>& inputs,
                                         uint64_t stream) {
    std::vector<at::Tensor> slots;
    slots.reserve(inputs.size() + p.buffers.size());
    std::optional<c10::Device> device;
    for (const auto& t : inputs) {
      slots.push_back(t.has_value() ? *t : at::Tensor());
      if (!device && t.has_value() && t->defined()) device = t->device();
    }
    TORCH_CHECK(device.has_value(), "sdpatch native: a program needs at least one input tensor");
    c10::DeviceGuard guard(*device);  // the kernels were loaded in this device's context
    slots.resize(inputs.size() + p.buffers.size());
    for (const auto& launch : p.launches) {
      for (int slot : launch.allocate_first) {
        const Buffer& b = p.buffers[slot - inputs.size()];
        slots[slot] = at::empty_strided(b.sizes, b.strides, at::TensorOptions().dtype(b.dtype).device(*device));
      }
      std::vector<uint64_t> cells = launch.cells;
      std::vector<void*> params(cells.size());
      for (const auto& [param, slot] : launch.pointers) cells[param] = reinterpret_cast<uintptr_t>(slots[slot].data_ptr());
      for (size_t i = 0; i < cells.size(); ++i) params[i] = &cells[i];
      std::vector<TensorMap> maps(launch.maps.size());
      for (size_t i = 0; i < maps.size(); ++i) {
        const TensorMapSpec& m = launch.maps[i];
        const uint32_t element_strides[5] = {1, 1, 1, 1, 1};
        int rc = cu_tensor_map_encode_tiled()(&maps[i], m.dtype, static_cast<uint32_t>(m.dims.size()), slots[m.slot].data_ptr(),
                                              m.dims.data(), m.strides.data(), m.box.data(), element_strides,
                                              /*interleave=*/0, m.swizzle, kL2Promotion128B, m.oob_fill);
        TORCH_CHECK(rc == 0, "sdpatch native: cuTensorMapEncodeTiled failed with CUresult ", rc);
        params[m.param] = &maps[i];
      }
      int rc = cu_launch_kernel()(reinterpret_cast<void*>(launch.function), launch.grid[0], launch.grid[1], launch.grid[2],
                                  launch.threads, 1, 1, launch.shared_bytes, reinterpret_cast<void*>(stream), params.data(),
                                  nullptr);
      TORCH_CHECK(rc == 0, "sdpatch native: cuLaunchKernel failed with CUresult ", rc);
    }
    return slots;
  }

  std::map<std::vector<int64_t>, std::shared_ptr<Program>> programs_;
};

using MapArgs = std::tuple<int, int, int, int, int, std::vector<uint64_t>, std::vector<uint64_t>, std::vector<uint32_t>>;

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Program, std::shared_ptr<Program>>(m, "Program")
      .def(py::init<>())
      .def("buffer",
           [](Program& p, std::vector<int64_t> sizes, std::vector<int64_t> strides, at::ScalarType dtype) {
             p.buffers.push_back({std::move(sizes), std::move(strides), dtype});
           },
           "Add a buffer slot, allocated with these sizes, strides and dtype")
      .def("launch",
           [](Program& p, uint64_t function, std::vector<unsigned> grid, unsigned threads, unsigned shared_bytes,
              std::vector<uint64_t> cells, std::vector<std::pair<int, int>> pointers, std::vector<int> allocate_first,
              std::vector<MapArgs> map_args) {
             TORCH_CHECK(grid.size() == 3, "grid must have 3 dims");
             for (const auto& [param, slot] : pointers)
               TORCH_CHECK(param >= 0 && static_cast<size_t>(param) < cells.size(), "pointer parameter out of range");
             std::vector<TensorMapSpec> maps;
             for (auto& [param, slot, dtype, swizzle, oob_fill, dims, strides, box] : map_args) {
               TORCH_CHECK(param >= 0 && static_cast<size_t>(param) < cells.size(), "descriptor parameter out of range");
               TORCH_CHECK(!dims.empty() && dims.size() <= 5 && box.size() == dims.size() && strides.size() + 1 == dims.size(),
                           "a descriptor needs 1-5 dims, a box dim each and one stride fewer");
               maps.push_back({param, slot, dtype, swizzle, oob_fill, std::move(dims), std::move(strides), std::move(box)});
             }
             p.launches.push_back({function, {grid[0], grid[1], grid[2]}, threads, shared_bytes, std::move(cells),
                                   std::move(pointers), std::move(allocate_first), std::move(maps)});
           },
           "Add a kernel launch: parameter cells, which of them take a slot's data pointer, the buffers it allocates "
           "first, and which take a TMA descriptor of a slot: (parameter, slot, data type, swizzle, OOB fill, dims, "
           "byte strides, box), innermost dim first")
      .def_readwrite("outputs", &Program::outputs);
  py::class_<Registry>(m, "Registry")
      .def(py::init<>())
      .def("add", &Registry::add)
      .def("run", &Registry::run, "The outputs of the program recorded for these inputs' layout, or None")
      .def("clear", &Registry::clear)
      .def("__len__", &Registry::size);
}
