#include "combs/backend/tensor.h"

#include <cassert>
#include <string>

#include "combs/backend/backend.h"

namespace combs {

// Owning (backend != nullptr) or borrowed memory.
struct TensorStorage {
  Backend* backend = nullptr;
  void* ptr = nullptr;
  bool host = false;  // Backend::alloc_host()'s

  TensorStorage(Backend* b, void* p, bool h = false) : backend(b), ptr(p), host(h) {}
  ~TensorStorage() {
    if (backend && host) backend->raw_free_host(ptr);
    else if (backend) backend->raw_free(ptr);
  }
  TensorStorage(const TensorStorage&) = delete;
  TensorStorage& operator=(const TensorStorage&) = delete;
};

Shape::Shape(std::initializer_list<int64_t> dims) {
  assert(dims.size() <= kMaxRank);
  for (int64_t d : dims) dims_[rank_++] = d;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::to_string() const {
  std::string s = "[";
  for (int i = 0; i < rank_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[i]);
  }
  return s + "]";
}

Tensor Tensor::wrap(void* data, Shape shape, DType dtype, DeviceType device) {
  Tensor t;
  t.storage_ = std::make_shared<TensorStorage>(nullptr, data);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

void* Tensor::data() const {
  return storage_ ? static_cast<char*>(storage_->ptr) + offset_ : nullptr;
}

Tensor Tensor::reshape(Shape shape) const {
  assert(shape.numel() == numel());
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  assert(rank() >= 1 && 0 <= begin && begin <= end && end <= dim(0));
  const int64_t row = dim(0) ? numel() / dim(0) : 0;
  Tensor t = *this;
  t.offset_ += nbytes_for(dtype_, begin * row);
  Shape s;
  switch (rank()) {
    case 1: s = Shape{end - begin}; break;
    case 2: s = Shape{end - begin, dim(1)}; break;
    case 3: s = Shape{end - begin, dim(1), dim(2)}; break;
    default: s = Shape{end - begin, dim(1), dim(2), dim(3)}; break;
  }
  t.shape_ = s;
  return t;
}

StatusOr<Tensor> Backend::alloc(Shape shape, DType dtype) { return allocate(shape, dtype, false); }

StatusOr<Tensor> Backend::alloc_host(Shape shape, DType dtype) { return allocate(shape, dtype, true); }

StatusOr<Tensor> Backend::allocate(Shape shape, DType dtype, bool host) {
  for (int i = 0; i < shape.rank(); ++i) {
    if (shape[i] < 0) return invalid_argument_error("negative dimension in shape " + shape.to_string());
  }
  if (shape.numel() % dtype_block_elems(dtype) != 0) {
    return invalid_argument_error("shape " + shape.to_string() + " is not a whole number of " +
                                  std::string(dtype_name(dtype)) + " blocks");
  }
  const size_t bytes = nbytes_for(dtype, shape.numel());
  void* p = host ? raw_alloc_host(bytes == 0 ? 1 : bytes) : raw_alloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) {
    return resource_exhausted_error(std::string(name()) + " backend: cannot allocate " +
                                    std::to_string(bytes) + (host ? " bytes of host memory" : " bytes") +
                                    " for a tensor of shape " + shape.to_string());
  }
  Tensor t;
  t.storage_ = std::make_shared<TensorStorage>(this, p, host);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = host ? DeviceType::kCpu : device_type();
  return t;
}

}  // namespace combs
