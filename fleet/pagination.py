from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import PageNumberPagination


class MeridianPagination(PageNumberPagination):
    """?page=N&page_size=M (at most 500), so a 100k-row list is never one response.

    A page that is not a number or past the last is bad input, a 400 naming "page" (DRF's own
    answer is a 404, which reads as "this list does not exist")."""

    page_size_query_param = "page_size"
    max_page_size = 500

    def paginate_queryset(self, queryset, request, view=None):
        try:
            return super().paginate_queryset(queryset, request, view=view)
        except NotFound as error:
            raise ValidationError({"page": [f"{error.detail}: pages are numbered from 1 to the last; "
                                            f"follow the answer's next and previous links"]}) from None


def paginate(view, queryset, serializer_class, *, context=None):
    """Returns the paginated response of one page of `queryset` serialized by `serializer_class`."""
    paginator = MeridianPagination()
    page = paginator.paginate_queryset(queryset, view.request, view=view)
    return paginator.get_paginated_response(serializer_class(page, many=True, context=context or {}).data)
