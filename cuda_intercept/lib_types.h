/* cudaDataType_t (library_types.h) as rgpu's cuBLAS and cuBLASLt forwarders need it: one element's bytes,
 * and which types are complex. Included by lib_cublas.c and lib_cublaslt.c. */
#ifndef RGPU_LIB_TYPES_H
#define RGPU_LIB_TYPES_H

#include <stddef.h>

/* Bytes of one element of cudaDataType_t `t`; 0: not one we know. */
static inline size_t rgpu_data_type_width(int t) {
    switch (t) {
    case 3: case 8: return 1;                              /* R_8I, R_8U */
    case 2: case 14: case 7: case 9: return 2;             /* R_16F, R_16BF, C_8I, C_8U */
    case 0: case 10: case 12: case 6: case 15: return 4;   /* R_32F, R_32I, R_32U, C_16F, C_16BF */
    case 1: case 4: case 11: case 13: return 8;            /* R_64F, C_32F, C_32I, C_32U */
    case 5: return 16;                                     /* C_64F */
    default: return 0;
    }
}

/* Complex types are the odd ones from C_32F on (C_32F 4, C_64F 5, C_16F 6, C_8I 7, ...). */
static inline int rgpu_data_type_complex(int t) {
    return (t >= 4 && t <= 7) || t == 9 || t == 11 || t == 13 || t == 15 || t == 17 || t == 19 || t == 21 ||
           t == 23 || t == 25 || t == 27;
}

#endif
