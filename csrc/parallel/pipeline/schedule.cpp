// The schedules' compute orders, one short function each, and the placement of the sends
// and receives they imply (add_communication).
#include "parallel/pipeline/schedule.h"

#include <algorithm>
#include <map>

#include "common/error.h"

namespace torchpar::pipeline {

namespace {

using Order = std::vector<Action>;

Action F(int mb, int stage) { return {ActionType::F, mb, stage}; }
Action B(int mb, int stage) { return {ActionType::B, mb, stage}; }
Action W(int mb, int stage) { return {ActionType::W, mb, stage}; }

// GPipe (Huang et al. 2019): every forward, then every backward; m micro-batches live.
Order gpipe(int rank, int m) {
  Order o;
  for (int i = 0; i < m; ++i) o.push_back(F(i, rank));
  for (int i = 0; i < m; ++i) o.push_back(B(i, rank));
  return o;
}

// 1F1B (PipeDream-Flush, arXiv:2104.04473): p - rank - 1 warm-up forwards, then one forward
// and one backward in turn, then the remaining backwards. At most p - rank micro-batches live.
Order one_f_one_b(int rank, int p, int m) {
  const int warmup = std::min(p - rank - 1, m);
  Order o;
  for (int i = 0; i < warmup; ++i) o.push_back(F(i, rank));
  for (int i = 0; i < m - warmup; ++i) {
    o.push_back(F(warmup + i, rank));
    o.push_back(B(i, rank));
  }
  for (int i = m - warmup; i < m; ++i) o.push_back(B(i, rank));
  return o;
}

// Interleaved 1F1B (arXiv:2104.04473 section 2.2), looped placement: rank r holds stages
// r, r + p, ..., r + (v-1)p. Forwards go in rounds of p micro-batches through chunk 0, then
// the same p through chunk 1, ...; backwards likewise from the last chunk. The warm-up,
// 2(p - rank - 1) + (v - 1)p, lets the last chunk's first backward arrive just in time.
Order interleaved(int rank, int p, int m, int v) {
  const int total = m * v;
  auto mb = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto chunk = [&](int k) { return (k / p) % v; };
  auto fwd = [&](int k) { return F(mb(k), chunk(k) * p + rank); };
  auto bwd = [&](int k) { return B(mb(k), (v - 1 - chunk(k)) * p + rank); };
  const int warmup = std::min(2 * (p - rank - 1) + (v - 1) * p, total);
  Order o;
  for (int k = 0; k < warmup; ++k) o.push_back(fwd(k));
  for (int k = 0; k < total - warmup; ++k) {
    o.push_back(fwd(warmup + k));
    o.push_back(bwd(k));
  }
  for (int k = total - warmup; k < total; ++k) o.push_back(bwd(k));
  return o;
}

// Zero bubble (Qi et al. 2023, arXiv:2401.10241 section 3.1): `order` with each backward split
// into B (input gradient, on the critical path between ranks) and W (weight gradient, local).
// B goes out at once; rank r holds back its r oldest W's, which then fill the gaps at the end
// where the unsplit order idles. A held-back W keeps its micro-batch live, so a rank's peak
// grows, but not past the unsplit order's busiest rank's (rank 0's, which holds none back):
// checked by simulation (tests/test_pipeline_schedule.py; a review ran p <= 8, m <= 32, v <= 4).
// From 1F1B this is ZB-H1: the bubble shrinks from (p-1)(tF+tB+tW) to (p-1)(tF+tB-tW); from
// interleaved 1F1B, torch's ScheduleInterleavedZeroBubble's kind of schedule, likewise over v.
Order split_backward(const Order& order, int rank) {
  Order o;
  std::vector<Action> held;  // W's not yet placed, oldest first
  size_t next = 0;
  for (const Action& a : order) {
    o.push_back(a);
    if (a.type != ActionType::B) continue;
    held.push_back(W(a.microbatch, a.stage));
    if (held.size() - next > static_cast<size_t>(rank)) o.push_back(held[next++]);
  }
  o.insert(o.end(), held.begin() + static_cast<std::ptrdiff_t>(next), held.end());
  return o;
}

// Breadth-first (Lamy-Poirier 2023, arXiv:2211.05953), looped placement: every micro-batch
// through this rank's first stage, then through its second, ...; then the backwards from the
// last stage, micro-batches in reverse (the last forwarded is the first whose gradient is
// ready). GPipe's memory (v m micro-batch-stages live); each stage's backwards run back to
// back, so its gradients are complete early and their data-parallel reduction overlaps the
// other stages' backwards (the paper's point). As torch's ScheduleLoopedBFS.
Order looped_bfs(int rank, int p, int m, int v) {
  Order o;
  for (int c = 0; c < v; ++c) {
    for (int i = 0; i < m; ++i) o.push_back(F(i, c * p + rank));
  }
  for (int c = v - 1; c >= 0; --c) {
    for (int i = m - 1; i >= 0; --i) o.push_back(B(i, c * p + rank));
  }
  return o;
}

bool is_compute(ActionType t) { return t == ActionType::F || t == ActionType::B || t == ActionType::W; }

}  // namespace

const char* action_name(ActionType t) {
  switch (t) {
    case ActionType::F: return "F";
    case ActionType::B: return "B";
    case ActionType::W: return "W";
    case ActionType::SEND_F: return "SEND_F";
    case ActionType::RECV_F: return "RECV_F";
    case ActionType::SEND_B: return "SEND_B";
    case ActionType::RECV_B: return "RECV_B";
  }
  return "?";
}

ActionType parse_action(const std::string& name) {
  for (auto t : {ActionType::F, ActionType::B, ActionType::W, ActionType::SEND_F, ActionType::RECV_F,
                 ActionType::SEND_B, ActionType::RECV_B}) {
    if (name == action_name(t)) return t;
  }
  TP_CHECK_USAGE(false, "unknown pipeline action '", name,
                 "' (expected F, B, W, SEND_F, RECV_F, SEND_B or RECV_B)");
  return ActionType::F;
}

ScheduleKind parse_kind(const std::string& name) {
  static const std::map<std::string, ScheduleKind> kinds = {
      {"gpipe", ScheduleKind::GPipe}, {"1f1b", ScheduleKind::OneFOneB},
      {"interleaved_1f1b", ScheduleKind::Interleaved1F1B}, {"zb_h1", ScheduleKind::ZeroBubbleH1},
      {"interleaved_zb", ScheduleKind::InterleavedZeroBubble}, {"looped_bfs", ScheduleKind::LoopedBFS},
      {"custom", ScheduleKind::Custom}};
  auto it = kinds.find(name);
  TP_CHECK_USAGE(it != kinds.end(), "unknown schedule kind '", name,
                 "' (expected gpipe, 1f1b, interleaved_1f1b, zb_h1, interleaved_zb, looped_bfs or custom)");
  return it->second;
}

Schedule make_schedule(ScheduleKind kind, int p, int m, int v) {
  TP_CHECK_USAGE(p >= 1, "pipeline schedule: number of ranks must be >= 1, got ", p);
  TP_CHECK_USAGE(m >= 1, "pipeline schedule: number of micro-batches must be >= 1, got ", m);
  TP_CHECK_USAGE(v >= 1, "pipeline schedule: stages per rank must be >= 1, got ", v);
  TP_CHECK_USAGE(kind != ScheduleKind::Custom, "make_schedule: a custom schedule comes from schedule_from_csv");
  if (kind == ScheduleKind::Interleaved1F1B || kind == ScheduleKind::InterleavedZeroBubble) {
    const char* name = kind == ScheduleKind::Interleaved1F1B ? "interleaved 1F1B" : "interleaved zero bubble";
    TP_CHECK_USAGE(p >= 2, name, " needs at least 2 pipeline ranks, got ", p);
    TP_CHECK_USAGE(m % p == 0, name, " needs the number of micro-batches (", m,
                   ") to be a multiple of the number of pipeline ranks (", p, ")");
  } else if (kind != ScheduleKind::LoopedBFS) {
    TP_CHECK_USAGE(v == 1, "only the interleaved schedules and looped BFS place several stages on a rank; got ",
                   v, " stages per rank");
  } else {
    // Its neighbouring stages would hand off to the one rank itself (review finding).
    TP_CHECK_USAGE(p >= 2 || v == 1, "looped BFS with ", v, " stages needs at least 2 pipeline ranks, got ", p);
  }
  Schedule s;
  s.kind = kind;
  s.num_ranks = p;
  s.num_microbatches = m;
  s.stages_per_rank = v;
  s.split_backward = kind == ScheduleKind::ZeroBubbleH1 || kind == ScheduleKind::InterleavedZeroBubble;
  for (int r = 0; r < p; ++r) {
    switch (kind) {
      case ScheduleKind::GPipe: s.actions.push_back(gpipe(r, m)); break;
      case ScheduleKind::OneFOneB: s.actions.push_back(one_f_one_b(r, p, m)); break;
      case ScheduleKind::Interleaved1F1B: s.actions.push_back(interleaved(r, p, m, v)); break;
      case ScheduleKind::ZeroBubbleH1: s.actions.push_back(split_backward(one_f_one_b(r, p, m), r)); break;
      case ScheduleKind::InterleavedZeroBubble: s.actions.push_back(split_backward(interleaved(r, p, m, v), r)); break;
      case ScheduleKind::LoopedBFS: s.actions.push_back(looped_bfs(r, p, m, v)); break;
      case ScheduleKind::Custom: break;
    }
  }
  return add_communication(std::move(s));
}

Schedule add_communication(Schedule s) {
  const int p = s.num_ranks, S = s.num_stages();
  std::vector<Order> compute(p);
  for (int r = 0; r < p; ++r) {
    for (const Action& a : s.actions[r]) {
      if (is_compute(a.type)) compute[r].push_back(a);
    }
  }
  // Messages each rank sends to each peer, in its compute order: the order the peer must
  // post its receives in (MPI-style matching by posting order; NCCL has nothing else).
  std::vector<std::map<int, Order>> recv_order(p);  // [receiver][sender] -> receives
  for (int r = 0; r < p; ++r) {
    for (const Action& a : compute[r]) {
      if (a.type == ActionType::F && a.stage + 1 < S) {
        recv_order[s.rank_of(a.stage + 1)][r].push_back({ActionType::RECV_F, a.microbatch, a.stage + 1});
      } else if (a.type == ActionType::B && a.stage > 0) {
        recv_order[s.rank_of(a.stage - 1)][r].push_back({ActionType::RECV_B, a.microbatch, a.stage - 1});
      }
    }
  }
  for (int r = 0; r < p; ++r) {
    const Order& c = compute[r];
    // before[k]: receives posted just before compute k.
    std::vector<Order> before(c.size() + 1);
    for (auto& [sender, recvs] : recv_order[r]) {
      // A receive is wanted one compute ahead of its use; a later receive from the same
      // sender may not be posted before an earlier one, so walk backwards taking the minimum.
      size_t limit = c.size();
      std::vector<size_t> slot(recvs.size());
      for (size_t k = recvs.size(); k-- > 0;) {
        const Action& rv = recvs[k];
        auto use_type = rv.type == ActionType::RECV_F ? ActionType::F : ActionType::B;
        auto it = std::find(c.begin(), c.end(), Action{use_type, rv.microbatch, rv.stage});
        TP_CHECK_USAGE(it != c.end(), "pipeline schedule: rank ", r, " receives ", action_name(rv.type),
                       " of micro-batch ", rv.microbatch, " for stage ", rv.stage, " but never runs ",
                       action_name(use_type), " of it");
        size_t use = static_cast<size_t>(it - c.begin());
        limit = std::min(limit, use == 0 ? 0 : use - 1);
        slot[k] = limit;
      }
      for (size_t k = 0; k < recvs.size(); ++k) before[slot[k]].push_back(recvs[k]);
    }
    Order out;
    for (size_t k = 0; k < c.size(); ++k) {
      out.insert(out.end(), before[k].begin(), before[k].end());
      const Action& a = c[k];
      out.push_back(a);
      if (a.type == ActionType::F && a.stage + 1 < S) out.push_back({ActionType::SEND_F, a.microbatch, a.stage});
      if (a.type == ActionType::B && a.stage > 0) out.push_back({ActionType::SEND_B, a.microbatch, a.stage});
    }
    s.actions[r] = std::move(out);
  }
  return s;
}

Schedule forward_only(const Schedule& s) {
  Schedule f = s;
  for (auto& list : f.actions) {
    std::erase_if(list, [](const Action& a) {
      return a.type != ActionType::F && a.type != ActionType::SEND_F && a.type != ActionType::RECV_F;
    });
  }
  return f;
}

double theoretical_bubble(ScheduleKind kind, int p, int m, int v) {
  switch (kind) {
    case ScheduleKind::Interleaved1F1B:
    case ScheduleKind::LoopedBFS: return double(p - 1) / (double(v) * m + p - 1);
    case ScheduleKind::ZeroBubbleH1: return double(p - 1) / (3.0 * m + p - 1);
    case ScheduleKind::InterleavedZeroBubble: return double(p - 1) / (3.0 * v * m + p - 1);
    default: return double(p - 1) / (m + p - 1);
  }
}

}  // namespace torchpar::pipeline
