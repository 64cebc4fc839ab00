// Tensor: a typed, shaped view of memory that a Backend owns.
//
// Layout: row-major and contiguous, the last dimension varies fastest; a tensor of shape
// [a, b, c] has element (i, j, k) at data + ((i * b + j) * c + k) * dtype_size. Views made by
// reshape() and rows() share the storage, which is freed by the backend that allocated it when the
// last view goes; the backend must outlive its tensors. wrap() views memory the caller keeps alive.
// Thread-compatible: distinct threads may use distinct Tensor objects viewing the same storage.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "combs/backend/dtype.h"

namespace combs {

class Backend;
struct TensorStorage;  // defined in tensor.cc

enum class DeviceType : uint8_t { kCpu, kCuda };

class Shape {
 public:
  static constexpr int kMaxRank = 4;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);

  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string to_string() const;  // "[2, 8, 64]"

 private:
  std::array<int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

class Tensor {
 public:
  Tensor() = default;  // undefined: no storage

  // A view of memory the caller owns and keeps alive for the tensor's lifetime.
  static Tensor wrap(void* data, Shape shape, DType dtype, DeviceType device = DeviceType::kCpu);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  DeviceType device() const { return device_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return nbytes_for(dtype_, numel()); }

  void* data() const;
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data());
  }

  // Same storage, new shape with the same number of elements (asserted).
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along dimension 0, sharing storage.
  Tensor rows(int64_t begin, int64_t end) const;

 private:
  friend class Backend;

  std::shared_ptr<TensorStorage> storage_;
  size_t offset_ = 0;  // bytes from the start of storage
  Shape shape_;
  DType dtype_ = DType::kF32;
  DeviceType device_ = DeviceType::kCpu;
};

}  // namespace combs
