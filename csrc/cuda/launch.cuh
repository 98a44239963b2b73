// Kernel launches go through MPF_LAUNCH so the unchanged kernels can also run on the host: under
// MPF_CUDA_HOST_EMULATION (defined by tests/cuda_emulation/cuda_runtime.h, which stands in for
// the toolkit header there) a launch runs every block as cooperative host threads.
//   MPF_LAUNCH(grid, block, stream, kernel)(args...)  ==  kernel<<<grid, block, 0, stream>>>(args...)
// The kernel comes last so a template-id with commas needs no parentheses.
#pragma once
#include <cuda_runtime.h>

#ifdef MPF_CUDA_HOST_EMULATION
#define MPF_LAUNCH(grid, block, stream, ...) ::mpf_emulation::launch(grid, block, stream, __VA_ARGS__)
#else
#define MPF_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<grid, block, 0, stream>>>
#endif
