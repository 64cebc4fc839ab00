#include "combs/kv/prefix_cache.h"

#include <cassert>

namespace combs {

PrefixCache::PrefixCache(PagePool& pool) : pool_(&pool), keys_(pool.num_pages()) {
  pool.set_reclaim_hook([this](int32_t page) { forget(page); });
}

PrefixCache::~PrefixCache() {
  clear();
  pool_->set_reclaim_hook({});
}

Digest PrefixCache::chain_root(std::string_view model_fingerprint, std::string_view ns) const {
  Sha256 h;
  h.update_framed("combs prefix cache v1");
  h.update_framed(model_fingerprint);
  h.update_framed(dtype_name(pool_->geometry().dtype));
  h.update_pod(static_cast<int64_t>(pool_->page_size()));
  h.update_framed(ns);
  return h.finish();
}

Digest PrefixCache::chain_next(const Digest& prev, std::span<const int32_t> tokens) {
  Sha256 h;
  h.update(prev.data(), prev.size());
  h.update(tokens.data(), tokens.size_bytes());
  return h.finish();
}

std::optional<int32_t> PrefixCache::find(const Digest& key) const {
  auto lock = pool_->bookkeeping_lock();
  auto it = pages_.find(key);
  if (it == pages_.end()) return std::nullopt;
  return it->second;
}

bool PrefixCache::insert(const Digest& key, int32_t page) {
  auto lock = pool_->bookkeeping_lock();
  if (keys_[page] || pages_.count(key)) return false;
  pages_.emplace(key, page);
  keys_[page] = key;
  pool_->cache_page(page);
  return true;
}

std::optional<Digest> PrefixCache::key_of(int32_t page) const {
  auto lock = pool_->bookkeeping_lock();
  return keys_[page];
}

void PrefixCache::forget(int32_t page) {
  assert(keys_[page]);
  pages_.erase(*keys_[page]);
  keys_[page].reset();
}

void PrefixCache::clear() {
  auto lock = pool_->bookkeeping_lock();
  for (auto& [key, page] : pages_) {
    keys_[page].reset();
    pool_->uncache_page(page);
  }
  pages_.clear();
}

int64_t PrefixCache::size() const {
  auto lock = pool_->bookkeeping_lock();
  return static_cast<int64_t>(pages_.size());
}

bool PrefixCache::consistent() const {
  auto lock = pool_->bookkeeping_lock();
  if (static_cast<int64_t>(pages_.size()) != pool_->num_cached()) return false;
  for (const auto& [key, page] : pages_) {
    if (!keys_[page] || *keys_[page] != key || !pool_->is_cached(page)) return false;
  }
  return true;
}

}  // namespace combs
