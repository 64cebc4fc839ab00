// GGUF (llama.cpp's model file format, versions 2 and 3): a memory-mapped reader that checks every
// header field, and a writer.
//
// File layout: magic "GGUF", u32 version, u64 tensor count, u64 metadata count; metadata as
// (string key, u32 type, value); tensor infos as (string name, u32 n_dims, u64 dims[n_dims] —
// dims[0] varies fastest —, u32 ggml type, u64 offset into the data section); the data section
// starts at the next multiple of general.alignment (default 32). Strings are u64 length + bytes.
// Little-endian throughout.
//
// A GgufFile is immutable after open() and safe to share between threads; tensor data points into
// the mapping and lives as long as the GgufFile.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "combs/backend/dtype.h"
#include "combs/base/sha256.h"
#include "combs/base/status.h"

namespace combs::gguf {

// ggml tensor types this reader knows the size of (others are rejected as unsupported).
enum class GgmlType : uint32_t { kF32 = 0, kF16 = 1, kQ8_0 = 8, kBF16 = 30 };
std::optional<DType> to_dtype(uint32_t ggml_type);
uint32_t to_ggml_type(DType t);

enum class ValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8,
  kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// A metadata value. Integers of every width are held as int64/uint64, floats as double; arrays
// keep their element type.
struct Value;
struct Array {
  ValueType type = ValueType::kU8;
  std::vector<Value> items;
};
struct Value {
  ValueType type = ValueType::kU8;
  std::variant<uint64_t, int64_t, double, bool, std::string, Array> v;

  static Value u32(uint32_t x) { return {ValueType::kU32, uint64_t{x}}; }
  static Value i32(int32_t x) { return {ValueType::kI32, int64_t{x}}; }
  static Value u64(uint64_t x) { return {ValueType::kU64, x}; }
  static Value f32(float x) { return {ValueType::kF32, double{x}}; }
  static Value boolean(bool x) { return {ValueType::kBool, x}; }
  static Value str(std::string s) { return {ValueType::kString, std::move(s)}; }
  static Value array(ValueType elem, std::vector<Value> items) {
    return {ValueType::kArray, Array{elem, std::move(items)}};
  }
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // dims[0] varies fastest (ggml's ne)
  DType dtype = DType::kF32;
  uint64_t offset = 0;        // within the data section
  uint64_t nbytes = 0;
  const void* data = nullptr;  // into the mapping (reader only)
  int64_t numel() const;
};

class GgufFile {
 public:
  // Maps and checks `path`. Errors name the file and the field: INVALID_ARGUMENT for a malformed
  // or truncated file, NOT_FOUND when it cannot be opened, UNIMPLEMENTED for an unsupported
  // version or tensor type.
  static StatusOr<std::unique_ptr<GgufFile>> open(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  const std::map<std::string, Value>& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // Gives the mapping's pages of a tensor's data back (MADV_DONTNEED; the whole pages inside it):
  // once a model has copied a tensor, the file's pages would otherwise stay resident beside the
  // copy (twice the model's size). The data stays readable: it is read from the file again where
  // touched.
  void drop_pages(const TensorInfo& t) const;
  const Value* find(std::string_view key) const;
  const TensorInfo* find_tensor(std::string_view name) const;

  // Typed metadata access; INVALID_ARGUMENT naming the key when missing or of another type.
  StatusOr<std::string> get_string(std::string_view key) const;
  StatusOr<uint64_t> get_uint(std::string_view key) const;  // any non-negative integer type
  StatusOr<double> get_float(std::string_view key) const;   // f32/f64 (or an integer)
  StatusOr<bool> get_bool(std::string_view key) const;
  StatusOr<const Array*> get_array(std::string_view key) const;

  // Names the model this file holds: SHA-256 over the metadata, the tensor table and the first
  // bytes of every tensor (so random-weight files of one shape differ too). Files that differ only
  // deep inside a tensor's data share it; the whole data is not read.
  Digest fingerprint() const;

 private:
  GgufFile() = default;
  std::string path_;
  uint32_t version_ = 0;
  std::map<std::string, Value> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
};

// Writes a GGUF v3 file: metadata in insertion order, then tensors (data copied from the given
// pointers), aligned to `alignment`.
class GgufWriter {
 public:
  void set(std::string key, Value value);
  // `data` holds nbytes_for(dtype, numel) bytes and must stay valid until write().
  void add_tensor(std::string name, std::vector<int64_t> dims, DType dtype, const void* data);
  // The data is produced into a buffer of nbytes_for(dtype, numel) bytes while writing, one
  // tensor at a time (so a file larger than memory can be written).
  void add_tensor(std::string name, std::vector<int64_t> dims, DType dtype,
                  std::function<void(void* dst)> produce);
  Status write(const std::string& path, uint32_t alignment = 32) const;

 private:
  std::vector<std::pair<std::string, Value>> metadata_;
  std::vector<TensorInfo> tensors_;
  std::vector<std::function<void(void*)>> producers_;  // one per tensor; empty when data is given
};

}  // namespace combs::gguf
