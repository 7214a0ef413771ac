// tests/emu_shard.cpp - one shard of the generated kernels for the CPU emulator
// (tests/cuda_emu.h), built once a shard with -DKDA_EMU_SHARD=s and linked into
// build/test_gpu_stages, which declares them all. make builds the shards at once.
#include "cuda_emu.h"
#include "../build/emu/kernels_emu.inc"
static_assert(KDA_EMU_SHARD >= 0 && KDA_EMU_SHARD < KDA_EMU_SHARDS, "the Makefile's shards differ from the generated file's");
