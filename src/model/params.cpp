#include "attnres/params.hpp"

#include <stdexcept>

namespace attnres {

int64_t ParamLayout::add(const std::string& name, std::vector<int64_t> shape, bool decay,
                         bool contiguous, ParamTag tag) {
  if (index_.count(name)) throw std::logic_error("duplicate parameter name " + name);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (contiguous && !entries_.empty()) total_ = entries_.back().offset + entries_.back().numel;
  ParamEntry e{name, std::move(shape), total_, n, decay, tag};
  total_ = (total_ + n + 15) / 16 * 16;
  index_[name] = entries_.size();
  entries_.push_back(std::move(e));
  return entries_.back().offset;
}

const ParamEntry* ParamLayout::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

int64_t ParamLayout::count() const {
  int64_t n = 0;
  for (const auto& e : entries_) n += e.numel;
  return n;
}

}  // namespace attnres
