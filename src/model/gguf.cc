#include "combs/model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <type_traits>
#include <variant>

#include "combs/backend/quant.h"

namespace combs::gguf {
namespace {

constexpr uint64_t kMaxDims = 4;
constexpr int kMaxArrayDepth = 4;

// Bounds-checked little-endian reads over the mapping; every failure names the field.
class Reader {
 public:
  Reader(const std::string& path, const uint8_t* data, size_t size)
      : path_(path), data_(data), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  Status error(const std::string& field, const std::string& what) const {
    return invalid_argument_error(path_ + ": " + field + ": " + what + " (at byte " +
                                  std::to_string(pos_) + " of " + std::to_string(size_) + ")");
  }

  template <typename T>
  Status read(T* out, const std::string& field) {
    if (remaining() < sizeof(T)) return error(field, "file is truncated");
    std::memcpy(out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return ok_status();
  }

  Status read_string(std::string* out, const std::string& field) {
    uint64_t len = 0;
    COMBS_RETURN_IF_ERROR(read(&len, field + " (string length)"));
    if (len > remaining()) {
      return error(field, "string length " + std::to_string(len) + " runs past the end of the file");
    }
    out->assign(reinterpret_cast<const char*>(data_ + pos_), len);
    pos_ += len;
    return ok_status();
  }

  Status read_value(ValueType type, Value* out, const std::string& field, int depth) {
    out->type = type;
    switch (type) {
      case ValueType::kU8: return read_int<uint8_t>(out, field);
      case ValueType::kI8: return read_int<int8_t>(out, field);
      case ValueType::kU16: return read_int<uint16_t>(out, field);
      case ValueType::kI16: return read_int<int16_t>(out, field);
      case ValueType::kU32: return read_int<uint32_t>(out, field);
      case ValueType::kI32: return read_int<int32_t>(out, field);
      case ValueType::kU64: return read_int<uint64_t>(out, field);
      case ValueType::kI64: return read_int<int64_t>(out, field);
      case ValueType::kF32: {
        float f = 0;
        COMBS_RETURN_IF_ERROR(read(&f, field));
        out->v = double{f};
        return ok_status();
      }
      case ValueType::kF64: {
        double f = 0;
        COMBS_RETURN_IF_ERROR(read(&f, field));
        out->v = f;
        return ok_status();
      }
      case ValueType::kBool: {
        uint8_t b = 0;
        COMBS_RETURN_IF_ERROR(read(&b, field));
        if (b > 1) return error(field, "bool value " + std::to_string(b) + " is neither 0 nor 1");
        out->v = b == 1;
        return ok_status();
      }
      case ValueType::kString: {
        std::string s;
        COMBS_RETURN_IF_ERROR(read_string(&s, field));
        out->v = std::move(s);
        return ok_status();
      }
      case ValueType::kArray: {
        if (depth >= kMaxArrayDepth) return error(field, "arrays nested too deeply");
        uint32_t elem = 0;
        uint64_t count = 0;
        COMBS_RETURN_IF_ERROR(read(&elem, field + " (array type)"));
        COMBS_RETURN_IF_ERROR(read(&count, field + " (array length)"));
        if (elem > static_cast<uint32_t>(ValueType::kF64)) {
          return error(field, "unknown array element type " + std::to_string(elem));
        }
        if (count > remaining()) {  // every element takes at least one byte
          return error(field, "array length " + std::to_string(count) + " runs past the end of the file");
        }
        Array a;
        a.type = static_cast<ValueType>(elem);
        a.items.resize(count);
        for (uint64_t i = 0; i < count; ++i) {
          COMBS_RETURN_IF_ERROR(read_value(a.type, &a.items[i], field, depth + 1));
        }
        out->v = std::move(a);
        return ok_status();
      }
    }
    return error(field, "unknown value type " + std::to_string(static_cast<uint32_t>(type)));
  }

 private:
  template <typename T>
  Status read_int(Value* out, const std::string& field) {
    T x{};
    COMBS_RETURN_IF_ERROR(read(&x, field));
    if constexpr (std::is_signed_v<T>) out->v = int64_t{x};
    else out->v = uint64_t{x};
    return ok_status();
  }

  const std::string& path_;
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// "F32, F16, BF16, Q4_0, ..., MXFP4": the types tensors may have.
std::string supported_types() {
  std::string s = "F32, F16, BF16";
  for (const QuantFormat& f : quant_formats()) s += ", " + std::string(f.name);
  return s;
}

}  // namespace

std::optional<DType> to_dtype(uint32_t ggml_type) {
  switch (static_cast<GgmlType>(ggml_type)) {
    case GgmlType::kF32: return DType::kF32;
    case GgmlType::kF16: return DType::kF16;
    case GgmlType::kBF16: return DType::kBF16;
    default: break;
  }
  if (const QuantFormat* f = quant_format(ggml_type)) return f->dtype;
  return std::nullopt;
}

uint32_t to_ggml_type(DType t) {
  switch (t) {
    case DType::kF32: return static_cast<uint32_t>(GgmlType::kF32);
    case DType::kF16: return static_cast<uint32_t>(GgmlType::kF16);
    case DType::kBF16: return static_cast<uint32_t>(GgmlType::kBF16);
    default: return quant_format(t)->ggml_type;
  }
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

StatusOr<std::unique_ptr<GgufFile>> GgufFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return not_found_error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument_error(path + ": not a regular file");
  }
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = path;
  f->map_size_ = static_cast<size_t>(st.st_size);
  if (f->map_size_ > 0) {
    void* m = mmap(nullptr, f->map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      ::close(fd);
      return internal_error(path + ": mmap failed: " + std::strerror(errno));
    }
    f->map_ = m;
  }
  ::close(fd);

  Reader r(path, static_cast<const uint8_t*>(f->map_), f->map_size_);
  char magic[4];
  COMBS_RETURN_IF_ERROR(r.read(&magic, "magic"));
  if (std::memcmp(magic, "GGUF", 4) != 0) return r.error("magic", "not a GGUF file (magic is not 'GGUF')");
  COMBS_RETURN_IF_ERROR(r.read(&f->version_, "version"));
  if (f->version_ != 2 && f->version_ != 3) {
    return unimplemented_error(path + ": version: GGUF version " + std::to_string(f->version_) +
                               " is not supported (2 and 3 are)");
  }
  uint64_t n_tensors, n_kv;
  COMBS_RETURN_IF_ERROR(r.read(&n_tensors, "tensor_count"));
  COMBS_RETURN_IF_ERROR(r.read(&n_kv, "metadata_kv_count"));
  if (n_kv > r.remaining() || n_tensors > r.remaining()) {
    return r.error("header", "counts (" + std::to_string(n_kv) + " metadata, " +
                                 std::to_string(n_tensors) + " tensors) exceed the file size");
  }
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string field = "metadata[" + std::to_string(i) + "]";
    std::string key;
    COMBS_RETURN_IF_ERROR(r.read_string(&key, field + ".key"));
    uint32_t type;
    COMBS_RETURN_IF_ERROR(r.read(&type, "metadata '" + key + "' type"));
    if (type > static_cast<uint32_t>(ValueType::kF64)) {
      return r.error("metadata '" + key + "'", "unknown value type " + std::to_string(type));
    }
    Value v;
    COMBS_RETURN_IF_ERROR(r.read_value(static_cast<ValueType>(type), &v, "metadata '" + key + "'", 0));
    if (!f->metadata_.emplace(key, std::move(v)).second) {
      return r.error("metadata '" + key + "'", "duplicate key");
    }
  }
  uint64_t alignment = 32;
  if (f->find("general.alignment")) {
    auto a = f->get_uint("general.alignment");
    if (!a.ok()) return a.status();
    alignment = *a;
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > (1u << 20)) {
      return r.error("general.alignment", "must be a power of two, got " + std::to_string(alignment));
    }
  }
  f->tensors_.resize(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo& t = f->tensors_[i];
    const std::string field = "tensor[" + std::to_string(i) + "]";
    COMBS_RETURN_IF_ERROR(r.read_string(&t.name, field + ".name"));
    const std::string tf = "tensor '" + t.name + "'";
    uint32_t n_dims;
    COMBS_RETURN_IF_ERROR(r.read(&n_dims, tf + " n_dims"));
    if (n_dims < 1 || n_dims > kMaxDims) {
      return r.error(tf + " n_dims", "must be in [1, 4], got " + std::to_string(n_dims));
    }
    int64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t dim;
      COMBS_RETURN_IF_ERROR(r.read(&dim, tf + " dims"));
      if (dim < 1 || dim > (uint64_t{1} << 40) || uint64_t(numel) * dim > (uint64_t{1} << 50)) {
        return r.error(tf + " dims", "dimension " + std::to_string(dim) + " is out of range");
      }
      t.dims.push_back(static_cast<int64_t>(dim));
      numel *= static_cast<int64_t>(dim);
    }
    uint32_t type;
    COMBS_RETURN_IF_ERROR(r.read(&type, tf + " type"));
    const std::optional<DType> dt = to_dtype(type);
    if (!dt) {
      // Name the type (a Q4_K_M file is refused at its first Q4_K or Q6_K tensor, say).
      return unimplemented_error(path + ": " + tf + " type: ggml type " + std::to_string(type) + " (" +
                                 ggml_type_name(type) + ") is not supported (" + supported_types() + " are)");
    }
    t.dtype = *dt;
    if (t.dims[0] % dtype_block_elems(t.dtype) != 0) {
      return r.error(tf + " dims", "row length " + std::to_string(t.dims[0]) +
                                       " is not a multiple of the " +
                                       std::string(dtype_name(t.dtype)) + " block size");
    }
    t.nbytes = nbytes_for(t.dtype, numel);
    COMBS_RETURN_IF_ERROR(r.read(&t.offset, tf + " offset"));
    if (t.offset % alignment != 0) {
      return r.error(tf + " offset", "offset " + std::to_string(t.offset) +
                                         " is not a multiple of the alignment " +
                                         std::to_string(alignment));
    }
    if (!f->tensor_index_.emplace(t.name, i).second) return r.error(tf, "duplicate tensor name");
  }
  const uint64_t data_start = (r.pos() + alignment - 1) / alignment * alignment;
  if (n_tensors > 0 && data_start > f->map_size_) {
    return r.error("data section", "file is truncated before the tensor data");
  }
  const uint64_t data_size = f->map_size_ > data_start ? f->map_size_ - data_start : 0;
  for (TensorInfo& t : f->tensors_) {
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      return invalid_argument_error(path + ": tensor '" + t.name + "' offset: data [" +
                                    std::to_string(t.offset) + ", " +
                                    std::to_string(t.offset + t.nbytes) +
                                    ") runs past the end of the data section (" +
                                    std::to_string(data_size) + " bytes; is the file truncated?)");
    }
    t.data = static_cast<const uint8_t*>(f->map_) + data_start + t.offset;
  }
  return f;
}

void GgufFile::drop_pages(const TensorInfo& t) const {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(t.data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(t.data) + t.nbytes) / page * page;
  if (begin < end) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

GgufFile::~GgufFile() {
  if (map_ != nullptr) munmap(map_, map_size_);
}

const Value* GgufFile::find(std::string_view key) const {
  auto it = metadata_.find(std::string(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

const TensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {
Status missing(const std::string& path, std::string_view key, const char* want) {
  return invalid_argument_error(path + ": metadata '" + std::string(key) + "': missing or not " + want);
}
}  // namespace

StatusOr<std::string> GgufFile::get_string(std::string_view key) const {
  const Value* v = find(key);
  if (!v || v->type != ValueType::kString) return missing(path_, key, "a string");
  return std::get<std::string>(v->v);
}

StatusOr<uint64_t> GgufFile::get_uint(std::string_view key) const {
  const Value* v = find(key);
  if (v) {
    if (auto* u = std::get_if<uint64_t>(&v->v)) return *u;
    if (auto* i = std::get_if<int64_t>(&v->v); i && *i >= 0) return static_cast<uint64_t>(*i);
  }
  return missing(path_, key, "a non-negative integer");
}

StatusOr<double> GgufFile::get_float(std::string_view key) const {
  const Value* v = find(key);
  if (v) {
    if (auto* d = std::get_if<double>(&v->v)) return *d;
    if (auto* u = std::get_if<uint64_t>(&v->v)) return static_cast<double>(*u);
    if (auto* i = std::get_if<int64_t>(&v->v)) return static_cast<double>(*i);
  }
  return missing(path_, key, "a number");
}

StatusOr<bool> GgufFile::get_bool(std::string_view key) const {
  const Value* v = find(key);
  if (!v || v->type != ValueType::kBool) return missing(path_, key, "a bool");
  return std::get<bool>(v->v);
}

StatusOr<const Array*> GgufFile::get_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v || v->type != ValueType::kArray) return missing(path_, key, "an array");
  return &std::get<Array>(v->v);
}

// ---- Writer ----

void GgufWriter::set(std::string key, Value value) {
  for (auto& [k, v] : metadata_) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  metadata_.emplace_back(std::move(key), std::move(value));
}

void GgufWriter::add_tensor(std::string name, std::vector<int64_t> dims, DType dtype,
                            const void* data) {
  TensorInfo t;
  t.name = std::move(name);
  t.dims = std::move(dims);
  t.dtype = dtype;
  t.nbytes = nbytes_for(dtype, t.numel());
  t.data = data;
  tensors_.push_back(std::move(t));
  producers_.emplace_back();
}

void GgufWriter::add_tensor(std::string name, std::vector<int64_t> dims, DType dtype,
                            std::function<void(void*)> produce) {
  add_tensor(std::move(name), std::move(dims), dtype, nullptr);
  producers_.back() = std::move(produce);
}

namespace {

class Out {
 public:
  explicit Out(std::ofstream& f) : f_(f) {}
  template <typename T>
  void put(const T& x) {
    f_.write(reinterpret_cast<const char*>(&x), sizeof x);
    n_ += sizeof x;
  }
  void str(const std::string& s) {
    put(uint64_t{s.size()});
    f_.write(s.data(), static_cast<std::streamsize>(s.size()));
    n_ += s.size();
  }
  void bytes(const void* p, size_t len) {
    f_.write(static_cast<const char*>(p), static_cast<std::streamsize>(len));
    n_ += len;
  }
  void pad_to(uint64_t alignment) {
    while (n_ % alignment) put(uint8_t{0});
  }
  void value(const Value& v) {
    switch (v.type) {
      case ValueType::kU8: put(static_cast<uint8_t>(std::get<uint64_t>(v.v))); break;
      case ValueType::kI8: put(static_cast<int8_t>(std::get<int64_t>(v.v))); break;
      case ValueType::kU16: put(static_cast<uint16_t>(std::get<uint64_t>(v.v))); break;
      case ValueType::kI16: put(static_cast<int16_t>(std::get<int64_t>(v.v))); break;
      case ValueType::kU32: put(static_cast<uint32_t>(std::get<uint64_t>(v.v))); break;
      case ValueType::kI32: put(static_cast<int32_t>(std::get<int64_t>(v.v))); break;
      case ValueType::kU64: put(std::get<uint64_t>(v.v)); break;
      case ValueType::kI64: put(std::get<int64_t>(v.v)); break;
      case ValueType::kF32: put(static_cast<float>(std::get<double>(v.v))); break;
      case ValueType::kF64: put(std::get<double>(v.v)); break;
      case ValueType::kBool: put(static_cast<uint8_t>(std::get<bool>(v.v))); break;
      case ValueType::kString: str(std::get<std::string>(v.v)); break;
      case ValueType::kArray: {
        const Array& a = std::get<Array>(v.v);
        put(static_cast<uint32_t>(a.type));
        put(uint64_t{a.items.size()});
        for (const Value& item : a.items) value(item);
        break;
      }
    }
  }
  uint64_t written() const { return n_; }

 private:
  std::ofstream& f_;
  uint64_t n_ = 0;
};

}  // namespace

Status GgufWriter::write(const std::string& path, uint32_t alignment) const {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return invalid_argument_error(path + ": cannot open for writing: " + std::strerror(errno));
  Out out(f);
  out.bytes("GGUF", 4);
  out.put(uint32_t{3});
  out.put(uint64_t{tensors_.size()});
  const bool has_alignment = alignment != 32;
  out.put(uint64_t{metadata_.size() + (has_alignment ? 1 : 0)});
  if (has_alignment) {
    out.str("general.alignment");
    out.put(static_cast<uint32_t>(ValueType::kU32));
    out.put(alignment);
  }
  for (const auto& [key, v] : metadata_) {
    out.str(key);
    out.put(static_cast<uint32_t>(v.type));
    out.value(v);
  }
  uint64_t offset = 0;
  for (const TensorInfo& t : tensors_) {
    out.str(t.name);
    out.put(static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) out.put(static_cast<uint64_t>(d));
    out.put(to_ggml_type(t.dtype));
    out.put(offset);
    offset += (t.nbytes + alignment - 1) / alignment * alignment;
  }
  out.pad_to(alignment);
  std::vector<char> buf;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const TensorInfo& t = tensors_[i];
    if (producers_[i]) {
      buf.resize(t.nbytes);
      producers_[i](buf.data());
      out.bytes(buf.data(), t.nbytes);
    } else {
      out.bytes(t.data, t.nbytes);
    }
    out.pad_to(alignment);
  }
  f.close();
  if (!f) return internal_error(path + ": write failed: " + std::strerror(errno));
  return ok_status();
}

namespace {
void hash_value(Sha256& h, const Value& v) {
  h.update_pod(static_cast<uint32_t>(v.type));
  h.update_pod(static_cast<uint32_t>(v.v.index()));
  std::visit(
      [&h](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) {
          h.update_framed(x);
        } else if constexpr (std::is_same_v<T, Array>) {
          h.update_pod(static_cast<uint32_t>(x.type));
          h.update_pod(static_cast<uint64_t>(x.items.size()));
          for (const Value& item : x.items) hash_value(h, item);
        } else {
          h.update_pod(x);
        }
      },
      v.v);
}
}  // namespace

Digest GgufFile::fingerprint() const {
  Sha256 h;
  h.update_framed("gguf model");
  h.update_pod(version_);
  h.update_pod(static_cast<uint64_t>(metadata_.size()));
  for (const auto& [key, value] : metadata_) {
    h.update_framed(key);
    hash_value(h, value);
  }
  h.update_pod(static_cast<uint64_t>(tensors_.size()));
  for (const TensorInfo& t : tensors_) {
    h.update_framed(t.name);
    h.update_pod(static_cast<uint64_t>(t.dims.size()));
    for (int64_t d : t.dims) h.update_pod(d);
    h.update_framed(dtype_name(t.dtype));
    h.update_pod(t.offset);
    h.update_pod(t.nbytes);
    if (t.data != nullptr) h.update(t.data, std::min<uint64_t>(t.nbytes, 64));
  }
  return h.finish();
}

}  // namespace combs::gguf
