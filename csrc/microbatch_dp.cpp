// Micro-batch construction by dynamic programming over ordered samples.
//
// DynaPipe (seed dynapipe.txt) section 4, Eq. 2 with the t_max enumeration: for a threshold T on
// the longest micro-batch, f(n; T) = min_i f(i; T) + t(M[i+1..n]) over contiguous ranges whose
// time is <= T and whose memory fits; the answer minimises (c-1) * max t + f(N; T) / |D|.
//
// Speed comes from three facts. Range costs only grow as a range extends to the left (costs are
// monotone in samples and padded length), so each scan stops at the first range over T and that
// range's cost is the next threshold worth trying. A lower bound on f (each sample's cheapest
// per-sample share at its own length) stops the enumeration once (c-1) * T alone cannot win. Range
// costs are computed lazily, only as far as the thresholds reach. The Python reference
// (dynapipe_planner/microbatch/reference_dp.py) mirrors this file operation for operation.
//
// Packed rows (issue 21; the packed micro-batches of Hydraulis seed hydraulis.txt §6.1): with
// `pack`, each range may run padded (b samples padded to its longest, s) or as its samples
// packed first-fit-decreasing into rows of L tokens, L either s or the batch's longest sample,
// attention only within each sample (varlen). Packed into r rows of L it costs
//   max_j ( T_j(r, L) - (r L^2 - sum_i l_i^2) * coef_j )
// with T_j stage j's monotone forward + backward table, and needs the memory of r rows of L.
// Padding never beats rows of s: interpolation weights are >= 0 and T_j is monotone, so
// T_j(r, s) <= T_j(b, s) <= T(b, s) (the max-over-stages table padding is priced with) for
// r <= b rows, the attention saved is >= 0 and coef_j >= 0, and r rows need no more memory than
// b. So with `pack` a range is priced at the cheaper of its two packings (rows of s win ties).
// Samples must come sorted by length: growing a range leftwards then adds a sample no longer
// than any before, so its first-fit-decreasing rows (for either L, fixed per band) are the
// shorter range's plus one first-fit step, kept per band. A new row can cost less than the
// attention it saves, so a range's price is raised to the shorter range's where it would fall
// below it: band costs stay monotone.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace {

struct Cell {
  int k;
  double w;
};

// Cell of x on an increasing grid; false beyond the last point (same rule as cost/table.py).
bool locate(const std::vector<double>& g, double x, Cell* cell) {
  const int n = static_cast<int>(g.size());
  if (x <= g[0]) {
    *cell = {0, 0.0};
    return true;
  }
  if (x > g[n - 1]) return false;
  const int k = static_cast<int>(std::upper_bound(g.begin(), g.end(), x) - g.begin()) - 1;
  if (k >= n - 1) {
    *cell = {n - 1, 0.0};
    return true;
  }
  *cell = {k, (x - g[k]) / (g[k + 1] - g[k])};
  return true;
}

double lerp(double a, double b, double w) {
  if (w == 0.0) return a;
  if (std::isinf(a) || std::isinf(b)) return kInf;
  return a + w * (b - a);
}

// A (b, s, t) table, trilinearly interpolated in the order t, then s, then b.
struct Table {
  const double* v;
  int ns, nt;
  double at(int ib, int is, int it) const {
    return v[(static_cast<int64_t>(ib) * ns + is) * nt + it];
  }
  double along_t(int ib, int is, const Cell& ct) const {
    const double v0 = at(ib, is, ct.k);
    return ct.w == 0.0 ? v0 : lerp(v0, at(ib, is, ct.k + 1), ct.w);
  }
  double along_s(int ib, const Cell& cs, const Cell& ct) const {
    const double v0 = along_t(ib, cs.k, ct);
    return cs.w == 0.0 ? v0 : lerp(v0, along_t(ib, cs.k + 1, ct), cs.w);
  }
  double interp(const Cell& cb, const Cell& cs, const Cell& ct) const {
    const double v0 = along_s(cb.k, cs, ct);
    return cb.w == 0.0 ? v0 : lerp(v0, along_s(cb.k + 1, cs, ct), cb.w);
  }
};

struct Problem {
  std::vector<int64_t> src, tgt;  // per ordered sample; tgt all zero for decoder-only models
  std::vector<double> bg, sg, tg;
  Table time, mem;
  bool pack = false;              // ranges may run as packed rows
  int64_t longest = 0;            // packing: the batch's longest sample (the longer row length)
  std::vector<Table> stage_time;  // per stage: monotone forward + backward (packing only)
  std::vector<double> coef;       // per stage: seconds per token^2 of attention
};

// Time of micro-batch [i..j] (inclusive), or +inf when it does not fit in memory or the grid.
double range_cost(const Problem& p, int64_t b, int64_t s, int64_t t) {
  Cell cb, cs, ct;
  if (!locate(p.bg, static_cast<double>(b), &cb) || !locate(p.sg, static_cast<double>(s), &cs) ||
      !locate(p.tg, static_cast<double>(t), &ct))
    return kInf;
  if (p.mem.interp(cb, cs, ct) > 1.0) return kInf;
  return p.time.interp(cb, cs, ct);
}

// Packed rows of one range at one row length, grown with the range (first-fit-decreasing).
struct Rows {
  int64_t length = 0;            // tokens per row
  std::vector<int64_t> room;     // free tokens per row
  int64_t most_room = 0;         // max of room: a sample longer than it opens a new row
  Cell cr{0, 0.0}, cs{0, 0.0};   // cells of the row count and the row length
  std::vector<double> row_time;  // per stage, the table's time at the current row count
  bool open = true;              // the rows still fit the grid and the memory
};

// Costs of the ranges ending at one sample, grown leftwards on demand. Growing a range adds one
// sample and can only raise its padded lengths, so each grid cell moves forward from the last
// one instead of being searched again (the cells equal what `locate` returns).
struct Band {
  std::vector<double> cost;  // cost[k]: range [j-k .. j]
  int64_t smax = 0, tmax = 0;
  Cell cb{0, 0.0}, cs{0, 0.0}, ct{0, 0.0};
  bool closed = false;  // the next range is infeasible (memory, grid or start of the batch)
  // Packed: rows of the range's longest sample, and rows of the batch's longest sample.
  Rows own, full;
  int64_t squares = 0;                // sum of the samples' squared lengths
  std::vector<uint8_t> on_full_rows;  // on_full_rows[k]: range [j-k .. j] packs to `full`
};

// Moves `cell` forward to x (never backward); false beyond the grid. Same result as locate().
bool advance(const std::vector<double>& g, double x, Cell* cell) {
  const int n = static_cast<int>(g.size());
  if (x > g[n - 1]) return false;
  int k = cell->k;
  while (k + 1 < n && g[k + 1] <= x) ++k;
  cell->k = k;
  cell->w = (x <= g[0] || k >= n - 1) ? 0.0 : (x - g[k]) / (g[k + 1] - g[k]);
  return true;
}

// First-fit step: a sample of `len` tokens into the first row with room, else a new row.
void place(int64_t len, Rows* rows) {
  if (len > rows->most_room) {
    rows->room.push_back(rows->length - len);
    rows->most_room = std::max(rows->most_room, rows->length - len);
    return;
  }
  auto row = std::find_if(rows->room.begin(), rows->room.end(),
                          [len](int64_t free) { return free >= len; });
  const bool was_most = *row == rows->most_room;
  *row -= len;
  if (was_most) rows->most_room = *std::max_element(rows->room.begin(), rows->room.end());
}

// Cost of the range as `rows` once sample `len` joins them (`squares` already counts it); inf,
// and closed for good, when the rows leave the grid or the memory. Stage times change only
// when a row is added.
double packed_cost(const Problem& p, int64_t len, int64_t squares, const Cell& ct, Rows* rows) {
  if (!rows->open) return kInf;
  const size_t before = rows->room.size();
  place(len, rows);
  const int64_t r = static_cast<int64_t>(rows->room.size());
  if (rows->room.size() != before) {
    if (!advance(p.bg, static_cast<double>(r), &rows->cr) ||
        p.mem.interp(rows->cr, rows->cs, ct) > 1.0) {
      rows->open = false;
      return kInf;
    }
    rows->row_time.resize(p.stage_time.size());
    for (size_t j = 0; j < p.stage_time.size(); ++j)
      rows->row_time[j] = p.stage_time[j].interp(rows->cr, rows->cs, ct);
  }
  const double saved = static_cast<double>(r * rows->length * rows->length - squares);
  double worst = -kInf;
  for (size_t j = 0; j < p.stage_time.size(); ++j)
    worst = std::max(worst, rows->row_time[j] - saved * p.coef[j]);
  return worst;
}

// First extension of a packed band: rows of sample j's length, and of the batch's longest when
// that is longer (else the two would be the same rows).
void start_rows(const Problem& p, int64_t j, Band* band) {
  band->own.length = p.src[j];
  band->full.length = p.longest;
  band->full.open = p.longest > p.src[j];
  if (!advance(p.sg, static_cast<double>(p.src[j]), &band->own.cs)) band->own.open = false;
  if (!advance(p.sg, static_cast<double>(p.longest), &band->full.cs)) band->full.open = false;
}

void extend(const Problem& p, int64_t j, Band* band) {
  const int64_t k = static_cast<int64_t>(band->cost.size());
  const int64_t i = j - k;
  if (i < 0) {
    band->closed = true;
    return;
  }
  band->smax = std::max(band->smax, p.src[i]);
  band->tmax = std::max(band->tmax, p.tgt[i]);
  if (!advance(p.sg, static_cast<double>(band->smax), &band->cs) ||
      !advance(p.tg, static_cast<double>(band->tmax), &band->ct)) {
    band->closed = true;
    return;
  }
  if (p.pack) {
    if (k == 0) start_rows(p, j, band);
    band->squares += p.src[i] * p.src[i];
    const double own = packed_cost(p, p.src[i], band->squares, band->ct, &band->own);
    const double full = packed_cost(p, p.src[i], band->squares, band->ct, &band->full);
    if (!band->own.open && !band->full.open) {
      band->closed = true;
      return;
    }
    const bool on_full = full < own;
    double cost = on_full ? full : own;
    if (k > 0) cost = std::max(cost, band->cost.back());
    band->cost.push_back(cost);
    band->on_full_rows.push_back(on_full ? 1 : 0);
    return;
  }
  if (!advance(p.bg, static_cast<double>(k + 1), &band->cb) ||
      p.mem.interp(band->cb, band->cs, band->ct) > 1.0) {
    band->closed = true;
    return;
  }
  band->cost.push_back(p.time.interp(band->cb, band->cs, band->ct));
}

// Largest feasible micro-batch size at one sample's own lengths (memory and grid), by bisection.
int64_t max_feasible_size(const Problem& p, int64_t s, int64_t t, int64_t limit) {
  int64_t lo = 1, hi = limit;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (std::isinf(range_cost(p, mid, s, t)))
      hi = mid - 1;
    else
      lo = mid;
  }
  return lo;
}

// Lower bound on f(N; T) for every T: each sample pays at least the cheapest per-sample share of
// a micro-batch padded to its own lengths. Between b-grid points t(b)/b is monotone, so only the
// grid points and the largest feasible size need checking.
double lower_bound_total(const Problem& p) {
  const int64_t n = static_cast<int64_t>(p.src.size());
  const int64_t bmax_grid = static_cast<int64_t>(p.bg.back());
  double total = 0.0, share = 0.0;
  int64_t last_s = -1, last_t = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (p.src[j] != last_s || p.tgt[j] != last_t) {
      last_s = p.src[j];
      last_t = p.tgt[j];
      const int64_t bmax = max_feasible_size(p, last_s, last_t, std::min(n, bmax_grid));
      share = range_cost(p, bmax, last_s, last_t) / static_cast<double>(bmax);
      for (double gb : p.bg) {
        const int64_t b = static_cast<int64_t>(gb);
        if (b > bmax) break;
        share = std::min(share, range_cost(p, b, last_s, last_t) / static_cast<double>(b));
      }
    }
    total += share;
  }
  return total;
}

// Lower bound on f(N; T) for every T when ranges are packed. A feasible range of r rows of L
// tokens (L its own longest sample or the batch's) interpolates stage j's table between the
// corners of a grid cell whose lower corner fits in memory (the memory table is monotone); at
// each such corner T_j >= phi_j * b * s + coef_j * b * s^2 (phi_j: the least per-token time
// beyond the attention over those corners), and interpolation keeps that (it reproduces b * s
// and over-estimates s^2). So the range costs at least sum_i (phi_j * l_i + coef_j * l_i^2), as
// r * L covers its tokens and the attention saved is r * L^2 - sum_i l_i^2; padding it costs no
// less. A stage with phi_j < 0 bounds nothing; the largest total is kept.
double packed_lower_bound_total(const Problem& p) {
  const int nb = static_cast<int>(p.bg.size()), ns = static_cast<int>(p.sg.size());
  auto fits = [&](int ib, int is) { return ib >= 0 && is >= 0 && p.mem.at(ib, is, 0) <= 1.0; };
  double best = 0.0;
  for (size_t j = 0; j < p.stage_time.size(); ++j) {
    const double c = p.coef[j];
    double phi = kInf;
    for (int ib = 0; ib < nb; ++ib) {
      for (int is = 0; is < ns; ++is) {
        const double v = p.stage_time[j].at(ib, is, 0);
        const bool used =
            fits(ib, is) || fits(ib - 1, is) || fits(ib, is - 1) || fits(ib - 1, is - 1);
        if (!used || std::isinf(v)) continue;
        const double b = p.bg[ib], s = p.sg[is];
        phi = std::min(phi, (v - b * s * s * c) / (b * s));
      }
    }
    if (!(phi >= 0.0) || std::isinf(phi)) continue;
    double total = 0.0;
    for (int64_t len : p.src) {
      const double l = static_cast<double>(len);
      total += phi * l + c * (l * l);
    }
    best = std::max(best, total);
  }
  return best;
}

struct Pass {
  double total = kInf;        // f(N; T)
  double max_cost = 0.0;      // longest micro-batch of the partition found
  double next = kInf;         // smallest range cost above T (the next threshold worth trying)
  std::vector<int64_t> ends;  // exclusive end of each micro-batch
  std::vector<int64_t> row_lengths;  // packed: each micro-batch's row length
  int64_t work = 0;                  // ranges priced: the DP's unit of work
};

Pass run_pass(const Problem& p, std::vector<Band>* bands, double threshold, std::vector<double>* f,
              std::vector<int64_t>* take) {
  const int64_t n = static_cast<int64_t>(p.src.size());
  Pass out;
  (*f)[0] = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    Band& band = (*bands)[j];
    while (!band.closed && band.cost.back() <= threshold) extend(p, j, &band);
    // Band costs never decrease, so the ranges within the threshold are a prefix.
    const int64_t cut =
        std::upper_bound(band.cost.begin(), band.cost.end(), threshold) - band.cost.begin();
    if (cut < static_cast<int64_t>(band.cost.size())) out.next = std::min(out.next, band.cost[cut]);
    const double* cost = band.cost.data();
    const double* fj = f->data() + j;  // fj[-k] == f[j - k]
    out.work += cut;
    double best = kInf;
    int64_t best_k = -1;  // the shortest range attaining the minimum
    for (int64_t k = 0; k < cut; ++k) {
      const double v = fj[-k] + cost[k];
      if (v < best) {
        best = v;
        best_k = k;
      }
    }
    (*f)[j + 1] = best;
    (*take)[j + 1] = best_k;
  }
  out.total = (*f)[n];
  if (std::isinf(out.total)) return out;
  for (int64_t end = n; end > 0; end -= (*take)[end] + 1) {
    out.ends.push_back(end);
    const Band& band = (*bands)[end - 1];
    out.max_cost = std::max(out.max_cost, band.cost[(*take)[end]]);
    if (p.pack)
      out.row_lengths.push_back(band.on_full_rows[(*take)[end]] ? band.full.length
                                                                : band.own.length);
  }
  std::reverse(out.ends.begin(), out.ends.end());
  std::reverse(out.row_lengths.begin(), out.row_lengths.end());
  return out;
}

std::vector<double> to_vector(
    const py::array_t<double, py::array::c_style | py::array::forcecast>& a) {
  return std::vector<double>(a.data(), a.data() + a.size());
}

py::dict microbatch_dp(py::array_t<int64_t, py::array::c_style | py::array::forcecast> src,
                       py::array_t<int64_t, py::array::c_style | py::array::forcecast> tgt,
                       py::array_t<double, py::array::c_style | py::array::forcecast> b_grid,
                       py::array_t<double, py::array::c_style | py::array::forcecast> s_grid,
                       py::array_t<double, py::array::c_style | py::array::forcecast> t_grid,
                       py::array_t<double, py::array::c_style | py::array::forcecast> time_table,
                       py::array_t<double, py::array::c_style | py::array::forcecast> mem_table,
                       int num_stages, int num_replicas, double bucket_abs, double bucket_rel,
                       int64_t work_budget,
                       py::array_t<double, py::array::c_style | py::array::forcecast> stage_time,
                       py::array_t<double, py::array::c_style | py::array::forcecast> coef) {
  Problem p;
  const int64_t n = src.size();
  p.src.assign(src.data(), src.data() + n);
  p.tgt.assign(n, 0);
  if (tgt.size() == n) p.tgt.assign(tgt.data(), tgt.data() + n);
  p.bg = to_vector(b_grid);
  p.sg = to_vector(s_grid);
  p.tg = to_vector(t_grid);
  const int ns = static_cast<int>(p.sg.size()), nt = static_cast<int>(p.tg.size());
  const int64_t cells = static_cast<int64_t>(p.bg.size()) * ns * nt;
  if (time_table.size() != cells || mem_table.size() != cells || n == 0)
    throw std::invalid_argument("microbatch_dp: table sizes do not match the grids, or no samples");
  p.time = {time_table.data(), ns, nt};
  p.mem = {mem_table.data(), ns, nt};
  // Packing: monotone time tables of the stages that can be slowest, with their attention
  // coefficients (`dp.packing_inputs`).
  p.pack = coef.size() > 0;
  if (p.pack) {
    if (stage_time.size() != cells * coef.size() || nt != 1)
      throw std::invalid_argument(
          "microbatch_dp: packing needs one table per coefficient and decoder-only grids");
    if (!std::is_sorted(p.src.begin(), p.src.end()))
      throw std::invalid_argument("microbatch_dp: packing needs samples sorted by length");
    for (int64_t j = 0; j < coef.size(); ++j) {
      if (!(coef.data()[j] >= 0.0))
        throw std::invalid_argument("microbatch_dp: attention coefficients must be >= 0");
      p.stage_time.push_back({stage_time.data() + j * cells, ns, nt});
      p.coef.push_back(coef.data()[j]);
    }
    p.longest = p.src.back();
  }

  py::dict result;
  int64_t infeasible = -1;
  double objective = kInf, passes = 0;
  int64_t work = 0;
  bool exhausted = false;
  Pass best;
  {
    py::gil_scoped_release release;
    const double bubble = num_stages - 1;
    const double replicas = num_replicas;
    std::vector<Band> bands(n);
    double threshold = 0.0;
    for (int64_t j = 0; j < n && infeasible < 0; ++j) {
      extend(p, j, &bands[j]);
      if (bands[j].cost.empty())
        infeasible = j;
      else
        threshold = std::max(threshold, bands[j].cost[0]);
    }
    if (infeasible < 0) {
      const double bound = (p.pack ? packed_lower_bound_total(p) : lower_bound_total(p)) / replicas;
      // (c-1) * (slowest single sample) + bound is at most the optimum, so spacing thresholds
      // by bucket_rel of it keeps the answer within bucket_rel of the optimum.
      const double width =
          std::max(bucket_abs, bucket_rel * (bubble * threshold + bound) / std::max(1.0, bubble));
      if (num_stages == 1) threshold = kInf;  // no bubble term: the loosest threshold is optimal
      std::vector<double> f(n + 1);
      std::vector<int64_t> take(n + 1);
      while (true) {
        Pass pass = run_pass(p, &bands, threshold, &f, &take);
        passes += 1;
        work += pass.work;
        const double obj = bubble * pass.max_cost + pass.total / replicas;
        if (obj < objective) {
          objective = obj;
          best = std::move(pass);
        }
        if (std::isinf(pass.next) || bubble * pass.next + bound >= objective) break;
        if (work_budget > 0 && work > work_budget) {
          exhausted = true;
          break;
        }
        threshold = std::max(pass.next, threshold + width);
      }
    }
  }
  result["infeasible_position"] = infeasible;
  result["ends"] = best.ends;
  result["row_lengths"] = best.row_lengths;
  result["objective"] = objective;
  result["max_time"] = best.max_cost;
  result["sum_time"] = best.total;
  result["passes"] = passes;
  result["work"] = work;
  result["budget_exhausted"] = exhausted;
  return result;
}

}  // namespace

void register_microbatch_dp(py::module_& m) {
  m.def("microbatch_dp", &microbatch_dp, py::arg("src"), py::arg("tgt"), py::arg("b_grid"),
        py::arg("s_grid"), py::arg("t_grid"), py::arg("time_table"), py::arg("mem_table"),
        py::arg("num_stages"), py::arg("num_replicas"), py::arg("bucket_abs"),
        py::arg("bucket_rel"), py::arg("work_budget"), py::arg("stage_time"), py::arg("coef"),
        "DynaPipe Eq. 2 DP over ordered samples, ranges padded or packed rows; see "
        "csrc/microbatch_dp.cpp.");
}
