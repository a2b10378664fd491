// Runs a schedule's action lists on a virtual clock to check them and to measure their
// bubble, with no process group: what the tests of every (kind, p, m, v) rely on.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "common/error.h"
#include "parallel/pipeline/schedule.h"

namespace torchpar::pipeline {

namespace {

struct Message {
  Action recv;   // the receive it must match
  double sent;   // time it leaves the sender (= arrives: messages are free)
};

std::string describe(int rank, const Action& a) {
  return "rank " + std::to_string(rank) + " " + action_name(a.type) + "(mb " + std::to_string(a.microbatch) +
         ", stage " + std::to_string(a.stage) + ")";
}

}  // namespace

SimulationResult simulate(const Schedule& s, const StageCosts* costs) {
  const int p = s.num_ranks, S = s.num_stages(), m = s.num_microbatches;
  TP_CHECK_USAGE(static_cast<int>(s.actions.size()) == p, "schedule has ", s.actions.size(),
                 " action lists for ", p, " ranks");
  if (costs) {
    TP_CHECK_USAGE(static_cast<int>(costs->size()) == S, "costs for ", costs->size(), " stages; the schedule has ", S);
    for (const auto& c : *costs) {
      for (double x : c) TP_CHECK_USAGE(std::isfinite(x) && x >= 0, "a cost must be finite and >= 0, got ", x);
    }
  }
  auto cost = [&](const Action& a) {
    const int i = a.type == ActionType::F ? 0 : a.type == ActionType::B ? 1 : a.type == ActionType::W ? 2 : -1;
    if (i < 0) return 0.0;  // messages are free
    if (costs) return (*costs)[a.stage][i];
    return a.type == ActionType::B && !s.split_backward ? 2.0 : 1.0;
  };
  // Every (micro-batch, stage) must be forwarded and backwarded exactly once on its rank.
  for (int r = 0; r < p; ++r) {
    std::map<std::tuple<int, int, int>, int> seen;
    for (const Action& a : s.actions[r]) {
      TP_CHECK_USAGE(a.microbatch >= 0 && a.microbatch < m && a.stage >= 0 && a.stage < S,
                     describe(r, a), ": micro-batch or stage out of range (m = ", m, ", stages = ", S, ")");
      TP_CHECK_USAGE(s.rank_of(a.stage) == r, describe(r, a), ": stage ", a.stage, " lives on rank ",
                     s.rank_of(a.stage));
      TP_CHECK_USAGE(++seen[std::make_tuple(int(a.type), a.microbatch, a.stage)] == 1, describe(r, a), " appears twice");
    }
  }

  SimulationResult res;
  res.busy.assign(p, 0);
  res.peak_in_flight.assign(p, 0);
  res.start.resize(p);
  std::vector<double> clock(p, 0);
  std::vector<size_t> pc(p, 0);
  std::vector<int> in_flight(p, 0);
  // Per (sender, receiver): messages sent, and receives posted, both in posting order.
  std::map<std::pair<int, int>, std::vector<Message>> sent;
  std::map<std::pair<int, int>, std::vector<Action>> posted;
  // Per rank: completion time of each compute (type, mb, stage); the receives it posted.
  std::vector<std::map<std::tuple<int, int, int>, double>> done(p);
  std::vector<std::set<std::pair<int, int>>> recv_posted_f(p), recv_posted_b(p);

  auto finished = [&](int r, ActionType t, int mb, int stage) -> const double* {
    auto it = done[r].find({int(t), mb, stage});
    return it == done[r].end() ? nullptr : &it->second;
  };
  // Time the data a receive asked for arrives, or nullptr while its send is not yet posted.
  auto arrival = [&](int sender, int r, const Action& recv) -> const double* {
    auto& q = posted[{sender, r}];
    auto pos = std::find(q.begin(), q.end(), recv);
    if (pos == q.end()) return nullptr;
    size_t k = static_cast<size_t>(pos - q.begin());
    auto& msgs = sent[{sender, r}];
    if (k >= msgs.size()) return nullptr;
    TP_CHECK_USAGE(msgs[k].recv == recv, "rank ", sender, " and rank ", r, " disagree on message ", k,
                   " between them: rank ", r, " posted ", describe(r, recv), ", rank ", sender, " sent the data for ",
                   describe(r, msgs[k].recv));
    return &msgs[k].sent;
  };

  size_t remaining = 0;
  for (auto& l : s.actions) remaining += l.size();
  while (remaining > 0) {
    bool moved = false;
    for (int r = 0; r < p; ++r) {
      while (pc[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][pc[r]];
        double ready = clock[r];
        bool can = true;
        switch (a.type) {
          case ActionType::RECV_F:
            TP_CHECK_USAGE(a.stage > 0, describe(r, a), ": the first stage has no input to receive");
            posted[{s.rank_of(a.stage - 1), r}].push_back(a);
            recv_posted_f[r].insert({a.microbatch, a.stage});
            break;
          case ActionType::RECV_B:
            TP_CHECK_USAGE(a.stage + 1 < S, describe(r, a), ": the last stage has no gradient to receive");
            posted[{s.rank_of(a.stage + 1), r}].push_back(a);
            recv_posted_b[r].insert({a.microbatch, a.stage});
            break;
          case ActionType::SEND_F:
            TP_CHECK_USAGE(a.stage + 1 < S && finished(r, ActionType::F, a.microbatch, a.stage), describe(r, a),
                           ": sent before its forward ran (or from the last stage)");
            sent[{r, s.rank_of(a.stage + 1)}].push_back({{ActionType::RECV_F, a.microbatch, a.stage + 1}, clock[r]});
            break;
          case ActionType::SEND_B:
            TP_CHECK_USAGE(a.stage > 0 && finished(r, ActionType::B, a.microbatch, a.stage), describe(r, a),
                           ": sent before its backward ran (or from the first stage)");
            sent[{r, s.rank_of(a.stage - 1)}].push_back({{ActionType::RECV_B, a.microbatch, a.stage - 1}, clock[r]});
            break;
          case ActionType::F:
            if (a.stage > 0) {
              TP_CHECK_USAGE(recv_posted_f[r].count({a.microbatch, a.stage}), describe(r, a),
                             " runs before the receive of its input was posted");
              const double* t = arrival(s.rank_of(a.stage - 1), r, {ActionType::RECV_F, a.microbatch, a.stage});
              if (!t) can = false; else ready = std::max(ready, *t);
            }
            break;
          case ActionType::B:
            TP_CHECK_USAGE(finished(r, ActionType::F, a.microbatch, a.stage), describe(r, a),
                           " runs before its forward");
            if (a.stage + 1 < S) {
              TP_CHECK_USAGE(recv_posted_b[r].count({a.microbatch, a.stage}), describe(r, a),
                             " runs before the receive of its output gradient was posted");
              const double* t = arrival(s.rank_of(a.stage + 1), r, {ActionType::RECV_B, a.microbatch, a.stage});
              if (!t) can = false; else ready = std::max(ready, *t);
            }
            break;
          case ActionType::W:
            TP_CHECK_USAGE(s.split_backward, describe(r, a), ": W in a schedule whose backward is not split");
            TP_CHECK_USAGE(finished(r, ActionType::B, a.microbatch, a.stage), describe(r, a), " runs before its B");
            break;
        }
        if (!can) break;
        const double c = cost(a);
        res.start[r].push_back(ready);
        clock[r] = ready + c;
        res.busy[r] += c;
        if (a.type == ActionType::F || a.type == ActionType::B || a.type == ActionType::W) {
          done[r][{int(a.type), a.microbatch, a.stage}] = clock[r];
        }
        // A micro-batch's activations live from its forward until its backward (its W when split).
        if (a.type == ActionType::F) res.peak_in_flight[r] = std::max(res.peak_in_flight[r], ++in_flight[r]);
        if ((a.type == ActionType::B && !s.split_backward) || a.type == ActionType::W) --in_flight[r];
        ++pc[r];
        --remaining;
        moved = true;
      }
    }
    if (!moved) {
      std::string where;
      for (int r = 0; r < p; ++r) {
        if (pc[r] < s.actions[r].size()) where += "\n  " + describe(r, s.actions[r][pc[r]]) + " waits";
      }
      TP_CHECK_USAGE(false, "pipeline schedule deadlocks:", where);
    }
  }
  // Every forward and backward ran, every message was received.
  for (int r = 0; r < p; ++r) {
    for (int st = r; st < S; st += p) {
      for (int mb = 0; mb < m; ++mb) {
        TP_CHECK_USAGE(finished(r, ActionType::F, mb, st), "rank ", r, " never runs F(mb ", mb, ", stage ", st, ")");
        TP_CHECK_USAGE(finished(r, ActionType::B, mb, st) || s.actions[r].empty() ||
                           std::none_of(s.actions[r].begin(), s.actions[r].end(),
                                        [](const Action& a) { return a.type == ActionType::B; }),
                       "rank ", r, " never runs B(mb ", mb, ", stage ", st, ")");
        TP_CHECK_USAGE(!s.split_backward || finished(r, ActionType::W, mb, st), "rank ", r, " never runs W(mb ", mb,
                       ", stage ", st, ")");
      }
    }
  }
  for (auto& [pair, msgs] : sent) {
    TP_CHECK_USAGE(msgs.size() == posted[pair].size(), "rank ", pair.first, " sends ", msgs.size(),
                   " messages to rank ", pair.second, ", which posts ", posted[pair].size(), " receives");
  }
  for (auto& [pair, recvs] : posted) {
    TP_CHECK_USAGE(recvs.size() == sent[pair].size(), "rank ", pair.second, " posts ", recvs.size(),
                   " receives from rank ", pair.first, ", which sends ", sent[pair].size());
  }
  res.makespan = *std::max_element(clock.begin(), clock.end());
  for (int r = 0; r < p; ++r) {
    res.bubble.push_back(res.makespan > 0 ? (res.makespan - res.busy[r]) / res.makespan : 0.0);
  }
  return res;
}

}  // namespace torchpar::pipeline
