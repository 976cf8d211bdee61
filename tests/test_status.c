/* Unit test for status.c: names are stable and messages compose. */
#include <stdio.h>
#include <string.h>

#include "base/status.h"
#include "check.h"

int main(void)
{
    CHECK(strcmp(fitm_status_name(FITM_OK), "ok") == 0);
    CHECK(strcmp(fitm_status_name(FITM_ERR_FORMAT), "format") == 0);
    CHECK(strcmp(fitm_status_name((fitm_status)999), "unknown") == 0);
    for (int s = 0; s < FITM_STATUS_COUNT; s++)
        CHECK(strcmp(fitm_status_name((fitm_status)s), "unknown") != 0);

    fitm_err e;
    CHECK(fitm_err_set(&e, FITM_ERR_FORMAT, "tensor '%s' bad", "x") == FITM_ERR_FORMAT);
    CHECK(strcmp(e.msg, "tensor 'x' bad") == 0);
    fitm_err_prefix(&e, "file %s", "m.gguf");
    CHECK(strcmp(e.msg, "file m.gguf: tensor 'x' bad") == 0);
    CHECK(fitm_err_set(NULL, FITM_ERR_IO, "ignored") == FITM_ERR_IO);
    fitm_err_prefix(NULL, "nothing");
    if (failures)
        return 1;
    printf("test_status: ok\n");
    return 0;
}
