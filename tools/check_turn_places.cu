// Host-only check of the deterministic Hopper backward's turn places (sm90/ordered_reduce.h,
// DqTurns::place): the closed forms against a count of the walks themselves. A key block's place at
// query block m is how many of the key blocks that add to m do so before it; a wrong place leaves a
// CTA waiting for a turn that never comes (the kernel traps after about a minute) or lets two add at
// once. Build and run:
//   nvcc -std=c++17 -I<cutlass>/include -Iinclude tools/check_turn_places.cu -o /tmp/check && /tmp/check
// - In-order walks (later_key_blocks_in_closed_form, without a mask and causal): the key blocks that add to m are
//   those whose query_block_range holds it, and they take turns last key block first.
// - Rotated walks (rotated_walk_place, no mask, as many query blocks as key blocks or more): key
//   block n reaches m at step (m - rotated_start(n)) mod m_blocks, and the earlier step goes first.
// Each (shape, m) must also hand out the places 0 .. count - 1 once each. Prints the mismatches per
// family and exits 1 on any (tests/test_turn_places.py runs it).
#include <cstdio>
#include <vector>

#include "flash_cutlass/common/block_info.h"

using namespace flash_cutlass;

// Whether the places of the key blocks adding to one query block are 0 .. count - 1, once each.
bool is_permutation(std::vector<int> const& places) {
  std::vector<int> seen(places.size(), 0);
  for (int place : places) {
    if (place < 0 || place >= int(places.size()) || seen[place]++) return false;
  }
  return true;
}

template <int kBlockM, int kBlockN, MaskKind kKind>
int check_in_order(int seqlen_q, int seqlen_k) {
  const KeyMask<kKind> mask{seqlen_q, seqlen_k, 0, 0};
  const int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
  int bad = 0;
  for (int m = 0; m < m_blocks; ++m) {
    std::vector<int> places;
    for (int n = 0; n < n_blocks; ++n) {
      const int2 own = query_block_range<kBlockM>(mask, n * kBlockN, kBlockN);
      if (!(own.x <= m && m < own.y)) continue;
      int later = 0;
      for (int other = n + 1; other < n_blocks; ++other) {
        const int2 range = query_block_range<kBlockM>(mask, other * kBlockN, kBlockN);
        later += range.x <= m && m < range.y;
      }
      const int place = later_key_blocks_in_closed_form<kBlockM, kBlockN>(mask, n, n_blocks, m);
      bad += place != later;
      places.push_back(place);
    }
    bad += !is_permutation(places);
  }
  return bad;
}

int check_rotated(int m_blocks, int n_blocks) {
  int bad = 0;
  for (int m = 0; m < m_blocks; ++m) {
    std::vector<int> places;
    for (int own = 0; own < n_blocks; ++own) {
      const int own_step = ((m - rotated_start(own, m_blocks, n_blocks)) % m_blocks + m_blocks) % m_blocks;
      int earlier = 0;
      for (int other = 0; other < n_blocks; ++other) {
        const int step = ((m - rotated_start(other, m_blocks, n_blocks)) % m_blocks + m_blocks) % m_blocks;
        earlier += other != own && step < own_step;
      }
      const int place = rotated_walk_place(own, m, m_blocks, n_blocks);
      bad += place != earlier;
      places.push_back(place);
    }
    bad += !is_permutation(places);
  }
  return bad;
}

template <int kBlockM, int kBlockN>
void check_block_shape(int* in_order_bad, int* shapes) {
  const int lengths[] = {1, 2, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 640, 1000, 1024, 1100, 2049, 4096};
  for (int seqlen_q : lengths) {
    for (int seqlen_k : lengths) {
      *in_order_bad += check_in_order<kBlockM, kBlockN, MaskKind::kNone>(seqlen_q, seqlen_k);
      *in_order_bad += check_in_order<kBlockM, kBlockN, MaskKind::kCausal>(seqlen_q, seqlen_k);
      *shapes += 2;
    }
  }
}

int main() {
  int in_order_bad = 0, in_order_shapes = 0;
  check_block_shape<64, 128>(&in_order_bad, &in_order_shapes);   // head dims 96 / 128
  check_block_shape<128, 128>(&in_order_bad, &in_order_shapes);  // head dim 64
  check_block_shape<64, 64>(&in_order_bad, &in_order_shapes);    // head dims 192 / 256
  int rotated_bad = 0, rotated_shapes = 0;
  // Every shape up to 70 query blocks, then a few longer walks (the rotated walks take at most 64 key
  // blocks: sm90/bwd_launch.h's kMaxRotatedKeyBlocks).
  std::vector<int> walk_lengths;
  for (int m_blocks = 1; m_blocks <= 70; ++m_blocks) walk_lengths.push_back(m_blocks);
  for (int m_blocks : {96, 127, 128, 255, 256}) walk_lengths.push_back(m_blocks);
  for (int m_blocks : walk_lengths) {
    for (int n_blocks = 1; n_blocks <= m_blocks && n_blocks <= 64; ++n_blocks) {
      rotated_bad += check_rotated(m_blocks, n_blocks);
      ++rotated_shapes;
    }
  }
  std::printf("in-order walks (no mask, causal): %d mismatches over %d shapes\n", in_order_bad, in_order_shapes);
  std::printf("rotated walks: %d mismatches over %d shapes\n", rotated_bad, rotated_shapes);
  return in_order_bad == 0 && rotated_bad == 0 ? 0 : 1;
}
