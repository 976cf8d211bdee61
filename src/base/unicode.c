#include "base/unicode.h"

#include "unicode_data.inc"

fitm_ucat fitm_unicode_category(uint32_t cp)
{
    if (cp > 0x10FFFF)
        return FITM_UCAT_UNASSIGNED;
    if (cp < 0x80) {
        /* ASCII fast path; same answers as the table. */
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z')
            return FITM_UCAT_LETTER;
        if (cp >= '0' && cp <= '9')
            return FITM_UCAT_NUMBER;
        if (cp < 0x20 || cp == 0x7F)
            return FITM_UCAT_OTHER;
        if (cp == ' ')
            return FITM_UCAT_SEPARATOR;
        if (cp == '$' || cp == '+' || cp == '<' || cp == '=' || cp == '>' || cp == '^' ||
            cp == '`' || cp == '|' || cp == '~')
            return FITM_UCAT_SYMBOL;
        return FITM_UCAT_PUNCT;
    }
    /* Last range whose first code point is <= cp. Entry 0 starts at U+0000. */
    size_t lo = 0, hi = sizeof fitm_unicode_ranges / sizeof fitm_unicode_ranges[0];
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if ((fitm_unicode_ranges[mid] >> 8) <= cp)
            lo = mid;
        else
            hi = mid;
    }
    return (fitm_ucat)(fitm_unicode_ranges[lo] & 0xFF);
}

bool fitm_unicode_is_whitespace(uint32_t cp)
{
    if (cp < 0x80)
        return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20;
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* Number of bytes a lead byte announces (0: not a valid lead byte), and the allowed range of
 * the byte after it, which is what rules out overlong forms, surrogates and > U+10FFFF. */
static int lead_info(unsigned char b, unsigned char *lo, unsigned char *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (b < 0x80)
        return 1;
    if (b < 0xC2)
        return 0;
    if (b < 0xE0)
        return 2;
    if (b < 0xF0) {
        if (b == 0xE0)
            *lo = 0xA0;
        else if (b == 0xED)
            *hi = 0x9F;
        return 3;
    }
    if (b < 0xF5) {
        if (b == 0xF0)
            *lo = 0x90;
        else if (b == 0xF4)
            *hi = 0x8F;
        return 4;
    }
    return 0;
}

size_t fitm_unicode_utf8_decode(const char *s, size_t n, uint32_t *cp)
{
    const unsigned char *u = (const unsigned char *)s;
    unsigned char lo, hi;
    int len = lead_info(u[0], &lo, &hi);
    if (len == 1) {
        *cp = u[0];
        return 1;
    }
    if (len == 0 || (size_t)len > n || u[1] < lo || u[1] > hi) {
        *cp = FITM_UNICODE_INVALID;
        return 1;
    }
    uint32_t v = u[0] & (0x7F >> len);
    for (int i = 1; i < len; i++) {
        if ((u[i] & 0xC0) != 0x80) {
            *cp = FITM_UNICODE_INVALID;
            return 1;
        }
        v = (v << 6) | (u[i] & 0x3F);
    }
    *cp = v;
    return (size_t)len;
}

size_t fitm_unicode_utf8_encode(uint32_t cp, char out[4])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    if (cp <= 0x10FFFF) {
        out[0] = (char)(0xF0 | (cp >> 18));
        out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[3] = (char)(0x80 | (cp & 0x3F));
        return 4;
    }
    return 0;
}

size_t fitm_unicode_utf8_complete(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    /* A cut character starts at most 3 bytes before the end. */
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        size_t p = n - back;
        if ((u[p] & 0xC0) == 0x80)
            continue; /* continuation byte: the start is further back */
        unsigned char lo, hi;
        int len = lead_info(u[p], &lo, &hi);
        if (len <= 1 || (size_t)len <= back)
            return n; /* ASCII, invalid lead, or a sequence that is already complete */
        if (back >= 2 && (u[p + 1] < lo || u[p + 1] > hi))
            return n; /* can never become valid */
        return p;
    }
    return n;
}
