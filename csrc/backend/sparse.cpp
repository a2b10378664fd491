// all_reduce(SUM) of sparse COO tensors (issue 23), as gloo does it: every rank's indices
// and values are gathered, put side by side and coalesced, which sums the values that share
// an index. Sparse embedding gradients (nn.Embedding(sparse=True)) are reduced this way.
#include "backend/sparse.h"

#include <algorithm>
#include <vector>

#include "backend/tensors.h"
#include "collectives/collectives.h"
#include "common/error.h"

namespace torchpar {

void check_sparse_allreduce(const at::Tensor& t, const c10d::ReduceOp& op) {
  TORCH_CHECK(t.device().is_cpu(), "torchpar all_reduce: sparse tensor is on ", t.device(),
              "; this torchpar build moves CPU tensors only");
  TORCH_CHECK(op.op_ == c10d::ReduceOp::SUM, "torchpar all_reduce: sparse tensors support only SUM, got op ",
              static_cast<int>(op.op_));
  check_tensor(t._values(), "all_reduce", "sparse tensor's values");
}

namespace {

// Whether every index lies inside the tensor's sizes. torch checks no sparse indices by default,
// and one outside would be written out of bounds wherever the sum is used (an optimizer adding a
// gradient into its parameter).
bool indices_in_range(const at::Tensor& indices, at::IntArrayRef sizes) {
  for (int64_t d = 0; d < indices.size(0) && indices.size(1) > 0; ++d) {
    auto [lo, hi] = at::aminmax(indices[d]);
    if (lo.item<int64_t>() < 0 || hi.item<int64_t>() >= sizes[d]) {
      return false;
    }
  }
  return true;
}

}  // namespace

void sparse_allreduce_sum(collectives::Comm& c, const at::Tensor& t) {
  // Checked before coalescing, which folds the indices of several sparse dimensions into one
  // linear index and can take one past a size into range. A bad tensor announces -1 nonzeros:
  // every rank then raises, before the indices are exchanged.
  const bool valid = indices_in_range(t._indices(), t.sizes());
  const at::Tensor in = valid ? t.coalesce() : t;
  const int size = c.size();
  // Every rank's shape record: nnz, sparse_dim, then the sizes. A rank with a different
  // number of dimensions publishes a record of another length: the all-gather refuses it.
  std::vector<int64_t> mine{valid ? in._nnz() : -1, in.sparse_dim()};
  for (auto s : in.sizes()) mine.push_back(s);
  const size_t rec = mine.size();
  std::vector<int64_t> all(rec * size);
  std::vector<void*> outs;
  for (int r = 0; r < size; ++r) outs.push_back(all.data() + r * rec);
  collectives::allgather(c, mine.data(), outs.data(), rec, at::kLong);
  int64_t max_nnz = 0;
  for (int r = 0; r < size; ++r) {
    TP_CHECK_USAGE(std::equal(all.begin() + r * rec + 1, all.begin() + (r + 1) * rec, mine.begin() + 1),
                   "sparse all_reduce: rank ", r, " has a tensor of another shape or sparse_dim than rank ",
                   c.rank(), " (sizes ", in.sizes(), ", sparse_dim ", in.sparse_dim(), ")");
    TP_CHECK_USAGE(all[r * rec] >= 0, "sparse all_reduce: rank ", r, "'s tensor has indices outside its sizes ",
                   in.sizes());
    max_nnz = std::max(max_nnz, all[r * rec]);
  }

  // Indices and values padded to the largest nnz, so that one all-gather of each suffices.
  const int64_t sd = in.sparse_dim();
  at::Tensor idx = at::zeros({sd, max_nnz}, in._indices().options());
  idx.narrow(1, 0, in._nnz()).copy_(in._indices());
  std::vector<int64_t> vshape{max_nnz};
  for (int64_t d = sd; d < in.dim(); ++d) vshape.push_back(in.size(d));
  at::Tensor val = at::zeros(vshape, in._values().options());
  val.narrow(0, 0, in._nnz()).copy_(in._values());

  at::Tensor idx_all = at::empty({size, sd, max_nnz}, idx.options());
  std::vector<int64_t> all_vshape{size};
  all_vshape.insert(all_vshape.end(), vshape.begin(), vshape.end());
  at::Tensor val_all = at::empty(all_vshape, val.options());
  for (auto [mine_t, all_t] : {std::pair{idx, idx_all}, std::pair{val, val_all}}) {
    Staged s = Staged::input(mine_t);
    Staged o = Staged::output(all_t);
    std::vector<void*> ptrs;
    for (int r = 0; r < size; ++r) ptrs.push_back(static_cast<char*>(o.data()) + r * s.count() * s.buffer.element_size());
    collectives::allgather(c, s.data(), ptrs.data(), s.count(), s.dtype());
    o.finish();
  }

  std::vector<at::Tensor> idxs, vals;
  for (int r = 0; r < size; ++r) {
    idxs.push_back(idx_all[r].narrow(1, 0, all[r * rec]));
    vals.push_back(val_all[r].narrow(0, 0, all[r * rec]));
    // The bytes came from the peers: checked again (every rank sees every part: all raise).
    TP_CHECK_USAGE(indices_in_range(idxs.back(), in.sizes()), "sparse all_reduce: rank ", r,
                   " sent indices outside the tensor's sizes ", in.sizes());
  }
  at::Tensor sum = at::sparse_coo_tensor(at::cat(idxs, 1), at::cat(vals, 0), in.sizes()).coalesce();
  write_back(t, sum);
}

}  // namespace torchpar
