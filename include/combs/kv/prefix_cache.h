// PrefixCache: full KV pages addressed by their content, so that sessions whose histories begin
// alike share the pages instead of prefilling them again (vLLM's hash-chained blocks).
//
// A page's key is a SHA-256 chain: link 0 names the model (its fingerprint), the cache's layout
// (K/V dtype, page size) and a namespace (the tenant: one tenant's pages never serve another); each
// next link hashes the previous one with the page's token ids. So a key names a page's tokens and
// every token before them, and a session finds its cached prefix by walking its own chain from the
// first page until a key is missing.
//
// The index holds one reference on each page it names (PagePool::cache_page): the page outlives
// the session that filled it, and a session that maps it shares it as a fork does (reference
// counts; writing into it copies it first). Pages that only the index holds are reclaimed by the
// pool, least recently released first, when it has no free page (the index forgets them through
// the pool's reclaim hook), so cached pages never make an allocation fail.
//
// Thread-safety: every call takes the pool's bookkeeping lock (the reclaim hook runs under it), so
// the index may be used from the engine's API threads and its scheduler at once.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "combs/base/sha256.h"
#include "combs/kv/page_pool.h"

namespace combs {

class PrefixCache {
 public:
  // Registers the pool's reclaim hook; the pool must outlive the cache.
  explicit PrefixCache(PagePool& pool);
  ~PrefixCache();  // unmarks every page it names (pages nothing else holds go back to the pool)
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // Link 0 of a chain: the model, this pool's layout, the namespace.
  Digest chain_root(std::string_view model_fingerprint, std::string_view ns) const;
  // The key of a full page of tokens (page_size of them) whose predecessor's key is `prev`
  // (chain_root for the first page).
  static Digest chain_next(const Digest& prev, std::span<const int32_t> tokens);

  // The page cached under `key`, or nullopt. The caller retains it (or the next allocation may
  // reclaim it) while still holding the pool's bookkeeping lock, or maps it at once.
  std::optional<int32_t> find(const Digest& key) const;
  // Names `page` (full, in use) by `key`. False (nothing changes) when the key already names a
  // page (another session filled the same content) or the page is named by another key.
  bool insert(const Digest& key, int32_t page);
  // The key naming `page`, or nullopt.
  std::optional<Digest> key_of(int32_t page) const;
  // Forgets every page.
  void clear();

  int64_t size() const;  // pages named
  PagePool& pool() const { return *pool_; }
  // Test hook: every named page is marked cached in the pool and the pool marks no other.
  bool consistent() const;

 private:
  void forget(int32_t page);  // the reclaim hook

  PagePool* pool_;
  std::unordered_map<Digest, int32_t, DigestHash> pages_;  // key -> page
  std::vector<std::optional<Digest>> keys_;                 // page -> key
};

}  // namespace combs
